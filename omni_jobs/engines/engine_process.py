"""An engine process: one DiT or code2wav engine, loaded and run apart from the worker that feeds it.

A stage worker's own Python (leases, commits, artifact writes, PNG encoding, Celery's consumer) runs on
many threads that share the interpreter's lock with the engine's thread. On a GPU host the engine
thread needs the lock for the CPU side of every step (kernel launches, preparing tensors) and waited
for it: on the H200 the worker's fixed cost held a 256 px DiT to 0.70 of a direct batch. In a process
of its own the engine has an interpreter to itself, as vLLM's engine core does.

Started by omni_jobs.engines.engine_client as ``python -m omni_jobs.engines.engine_process --fd N``,
where N is its end of a socket pair. It answers the worker's messages (omni_jobs.engines.engine_wire):
a ``Load`` first (which engine kind, ``Served``), then submitted requests for its batchers, and (DiT only)
``CheckTask`` and ``Generate`` calls one at a time, in order; a ``Stop`` for
the running call is read on a thread of its own, so that a call whose members were all canceled stops
at its next step. It exits when the worker closes the socket or dies: its reader sees the socket close.
(Not PR_SET_PDEATHSIG: the kernel sends that when the *thread* that started the process exits, and the
worker starts engines on threads that end after the load.)
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

import numpy as np
from PIL import Image

from omni_jobs.core.logs import configure_logging
from omni_jobs.core.settings import get_settings
from omni_jobs.engines import torchvision_free, turns
from omni_jobs.engines.allocator import tune_engine_malloc
from omni_jobs.engines.batching import Arrivals, Batcher, BatchPolicy, Member
from omni_jobs.engines.code2wav import Code2Wav, Code2WavRequest, first_chunks_first
from omni_jobs.engines.code2wav import group_key as code2wav_group
from omni_jobs.engines.dit import DiTLikeEngine, DiTOutput, DiTRequest, group_key
from omni_jobs.engines.engine_wire import (
    Answered,
    BatchStep,
    Block,
    Cancel,
    CheckTask,
    Done,
    Failed,
    FromEngine,
    Generate,
    Load,
    Loaded,
    Outcome,
    Outcomes,
    Preview,
    Started,
    Step,
    Stop,
    Stopped,
    Submit,
    ToEngine,
    WireCode2WavRequest,
    WireDiTOutput,
    WireDiTRequest,
    WirePolicy,
    encode,
    pack,
    to_engine,
    unpack,
)
from omni_jobs.engines.library_env import apply_engine_library_defaults
from omni_jobs.engines.pool import build_dit
from omni_jobs.media.payloads import AudioClip
from omni_jobs.media.previews import LatentPreview

log = logging.getLogger("omni_jobs.engine_process")
R = TypeVar("R")
O = TypeVar("O")
SendPreview = Callable[[int, LatentPreview], None]


class _Stopped(Exception):
    """The running call was stopped by the worker (every member canceled)."""


class Canceled(Exception):
    """A submitted request its worker canceled (the worker raises its own error for it)."""


@dataclass(frozen=True)
class Served(Generic[R, O]):
    """What the server needs of one engine kind to batch and answer its submitted requests: the one server, the
    one client (omni_jobs.engines.engine_client) and the one wire serve every kind."""

    name: str
    request: Callable[[Submit, SendPreview], R]
    """The submitted request, its arrays unpacked (previews, DiT's only, go to the callback)."""
    run: Callable[[list[R], Callable[[int, int], None]], list[O]]
    """A batch's outputs; the callback hears of each step (and raises to stop the batch)."""
    answer: Callable[[Sequence[tuple[R, O]]], tuple[tuple[WireDiTOutput, ...], Block | None]]
    group_key: Callable[[R], Hashable]
    rank: Callable[[R], int] | None = None
    turn: Callable[[], AbstractContextManager[object]] = nullcontext


def dit_served(engine: DiTLikeEngine) -> Served[DiTRequest, DiTOutput]:
    def request(message: Submit, send_preview: SendPreview) -> DiTRequest:
        assert isinstance(message.request, WireDiTRequest), "a DiT engine takes DiT requests"
        (one,) = _requests((message.request,), unpack(message.inputs), send_preview, indexes=(message.key,))
        return one

    return Served("dit", request, lambda batch, on_step: engine.generate(batch, on_step=on_step),
                  lambda done: _outputs([out for _, out in done]), group_key, turn=engine.turn)


def code2wav_served(engine: Code2Wav) -> Served[Code2WavRequest, AudioClip]:
    """Code2wav's batcher as the worker's own (``code2wav_batcher``): one length and voice a batch, streams' first
    windows first. A render has no steps to report: a canceled request is dropped before its batch runs."""
    def request(message: Submit, _previews: SendPreview) -> Code2WavRequest:
        w = message.request
        if not isinstance(w, WireCode2WavRequest):
            raise TypeError("a code2wav engine takes code2wav requests")
        unpack(message.inputs)  # none are sent; a block would be unlinked here
        return Code2WavRequest(w.request_id, w.codes, w.speaker, seed=w.seed, offset=w.offset, num_steps=w.num_steps,
                               guidance_scale=w.guidance_scale)

    def answer(done: Sequence[tuple[Code2WavRequest, AudioClip]]) -> tuple[tuple[WireDiTOutput, ...], Block | None]:
        return (tuple(WireDiTOutput(r.request_id, audio=i, sample_rate=clip.sample_rate)
                      for i, (r, clip) in enumerate(done)), pack([clip.samples for _, clip in done]))

    return Served("code2wav", request, lambda batch, _on_step: engine.render(batch), answer, code2wav_group,
                  rank=first_chunks_first)


class EngineServer(Generic[R, O]):
    """Serves one loaded engine over ``conn``.

    Submitted requests go to this process's batchers (one per stage policy, as a worker's), which form
    batches and run them here: the next batch starts as soon as the engine is free, without a round
    trip to the worker. A direct call (``Generate``, ``CheckTask``) runs in order on the serving thread.
    Cancels and stops are read beside them, on the reader thread."""

    def __init__(self, conn: Connection, served: Served[R, O], direct: DiTLikeEngine | None = None) -> None:
        self.conn = conn
        self.served = served
        self.engine = direct
        """The engine of direct calls (DiT's), if any."""
        self._work: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._stops: set[int] = set()
        self._canceled: set[int] = set()
        self._keys: dict[int, int] = {}  # id(request) -> its submit key, while it waits or runs
        self._started: dict[int, tuple[int, float]] = {}  # a running batch's first key -> its id, when it started
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # batcher threads and the serving thread all answer
        self._batchers: dict[WirePolicy, Batcher[R, O]] = {}
        self._batch_ids = itertools.count(1)

    def serve(self) -> None:
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        while (message := self._work.get()) is not None:
            self._handle(message)

    def _read(self) -> None:
        try:
            while True:
                message = to_engine.decode(self.conn.recv_bytes())
                if isinstance(message, Submit):
                    self._submit(message)
                elif isinstance(message, Cancel):
                    with self._lock:
                        self._canceled.add(message.key)
                elif isinstance(message, Stop):
                    with self._lock:
                        self._stops.add(message.call_id)
                else:
                    self._work.put(message)
        except (EOFError, OSError):
            os._exit(0)  # the worker is gone: no one to answer; running calls are dropped with the process

    def _send(self, message: FromEngine) -> None:
        data = encode(message)
        with self._sending:
            self.conn.send_bytes(data)

    # --- submitted requests: this process's batchers ---
    def _submit(self, message: Submit) -> None:
        try:
            request = self.served.request(message, self._previews(0))
        except Exception as exc:  # noqa: BLE001 - a malformed request fails alone, at once
            self._send(Outcomes(0, (Outcome(message.key, error=type(exc).__name__, message=str(exc)),), None))
            return
        with self._lock:
            self._keys[id(request)] = message.key
        self._batcher(message.policy).put(request, tenant=message.tenant)

    def _batcher(self, policy: WirePolicy) -> Batcher[R, O]:
        with self._lock:
            batcher = self._batchers.get(policy)
            if batcher is None:
                batch_policy = BatchPolicy(max_batch_size=policy.max_batch_size, wait_ms=policy.wait_ms,
                                           idle_release_s=policy.idle_release_s, burst_fill=policy.burst_fill)
                served = self.served
                batcher = Batcher(self._run_batch, batch_policy, group_key=served.group_key, rank=served.rank,
                                  name=served.name, turn=served.turn, on_done=self._settled, arrivals=Arrivals())
                self._batchers[policy] = batcher
            return batcher

    def _run_batch(self, batch: Sequence[Member[R, O]]) -> list[O | BaseException]:
        """One batch: its members' keys first, then a step message a step (of every member), then the
        engine's outputs; a member canceled meanwhile gets Canceled, and a batch whose members all were
        stops at its next step."""
        with self._lock:
            keys = tuple(self._keys[id(m.request)] for m in batch)
        batch_id = next(self._batch_ids)
        now = time.monotonic()
        with self._lock:
            self._started[keys[0]] = (batch_id, now)
        self._send(Started(batch_id, keys, now - batch[0].enqueued_at))

        def all_canceled() -> bool:
            with self._lock:
                return all(k in self._canceled for k in keys)

        def on_step(done: int, total: int) -> None:
            self._send(BatchStep(batch_id, done, total))
            if all_canceled():
                raise _Stopped()

        if all_canceled():
            return [Canceled() for _ in batch]
        try:
            outputs = self.served.run([m.request for m in batch], on_step)
        except _Stopped:
            return [Canceled() for _ in batch]
        with self._lock:
            return [Canceled() if k in self._canceled else out for k, out in zip(keys, outputs, strict=True)]

    def _settled(self, batch: Sequence[Member[R, O]]) -> None:
        """Every member's outcome, in one message, its images and tensors in one block."""
        with self._lock:
            keys = [self._keys.pop(id(m.request)) for m in batch]
            self._canceled.difference_update(keys)
            started = self._started.pop(keys[0], None)  # retried one by one, the first member's run counts
            for k in keys[1:]:
                self._started.pop(k, None)
        done = [(k, m.request, m.result) for k, m in zip(keys, batch, strict=True)
                if m.error is None and m.result is not None]
        wire, block = self.served.answer([(r, out) for _, r, out in done])
        outcomes = [Outcome(k, output=w) for (k, _, _), w in zip(done, wire, strict=True)]
        outcomes += [Outcome(k, error=type(m.error).__name__, message=str(m.error))
                     for k, m in zip(keys, batch, strict=True) if m.error is not None or m.result is None]
        batch_id, at = started if started is not None else (0, time.monotonic())
        self._send(Outcomes(batch_id, tuple(outcomes), block, time.monotonic() - at))

    # --- direct calls ---
    def _handle(self, message: ToEngine) -> None:
        call_id = getattr(message, "call_id", -1)
        try:
            if self.engine is None:
                raise TypeError(f"a {self.served.name} engine takes submitted requests only")
            if isinstance(message, CheckTask):
                self.engine.check_task(message.task, conditioned_on_embeds=message.conditioned_on_embeds)
                self._send(Answered(call_id))
            elif isinstance(message, Generate):
                self._generate(message)
            else:
                raise TypeError(f"unexpected message {type(message).__name__}")
        except _Stopped:
            self._send(Stopped(call_id))
        except Exception as exc:
            log.debug("call %d failed", call_id, exc_info=True)
            self._send(Failed(call_id, type(exc).__name__, str(exc)))
        finally:
            with self._lock:
                self._stops.discard(call_id)

    def _generate(self, call: Generate) -> None:
        assert self.engine is not None
        requests = _requests(call.requests, unpack(call.inputs), self._previews(call.call_id))

        def on_step(done: int, total: int) -> None:
            self._send(Step(call.call_id, done, total))
            with self._lock:
                if call.call_id in self._stops:
                    raise _Stopped()

        outputs = self.engine.generate(requests, on_step=on_step)
        wire, block = _outputs(outputs)
        self._send(Done(call.call_id, wire, block))

    def _previews(self, call_id: int) -> Callable[[int, LatentPreview], None]:
        def send(index: int, preview: LatentPreview) -> None:
            block = pack([preview.latents, preview.projection.weight, preview.projection.bias])
            assert block is not None
            self._send(Preview(call_id, index, preview.step, preview.total, preview.width, preview.height, block))

        return send


def _requests(wire: Sequence[WireDiTRequest], arrays: Sequence[object], send_preview: Callable[[int, LatentPreview], None],
              indexes: Sequence[int] | None = None) -> list[DiTRequest]:
    """DiTRequests: their tensors and images from the message's block; a request that wants previews hands
    them to ``send_preview(index, preview)``, its index in ``indexes`` (default: its place)."""
    out: list[DiTRequest] = []
    for i, w in zip(indexes if indexes is not None else range(len(wire)), wire, strict=True):
        image = embeds = None
        if w.prompt_embeds is not None:
            embeds = arrays[w.prompt_embeds]
        if w.image is not None:
            pixels = arrays[w.image]
            assert isinstance(pixels, np.ndarray)
            image = Image.fromarray(pixels)  # [h, w, 3] uint8: RGB
        out.append(DiTRequest(
            request_id=w.request_id, prompt=w.prompt, height=w.height, width=w.width,
            num_inference_steps=w.num_inference_steps, guidance_scale=w.guidance_scale, seed=w.seed,
            negative_prompt=w.negative_prompt,
            prompt_embeds=embeds,  # type: ignore[arg-type]  # a tensor, as the worker packed it
            image=image, strength=w.strength, duration_s=w.duration_s, want_latents=w.want_latents,
            num_frames=w.num_frames, preview_every=w.preview_every,
            on_preview=partial(send_preview, i) if w.preview_every else None,
        ))
    return out


def _outputs(outputs: Sequence[DiTOutput]) -> tuple[tuple[WireDiTOutput, ...], Block | None]:
    """The engine's DiTOutputs as wire outputs, their arrays in one block."""
    arrays: list[object] = []

    def put(value: object) -> int:
        arrays.append(value)
        return len(arrays) - 1

    wire = []
    for out in outputs:
        image = mode = None
        if out.image is not None:
            picture = out.image if out.image.mode in ("RGB", "RGBA", "L") else out.image.convert("RGB")
            image, mode = put(np.asarray(picture)), picture.mode
        wire.append(WireDiTOutput(
            out.request_id, image=image, image_mode=mode,
            audio=put(out.audio) if out.audio is not None else None, sample_rate=out.sample_rate,
            latents=put(out.latents) if out.latents is not None else None,
            video=put(out.video) if out.video is not None else None,
        ))
    return tuple(wire), pack(arrays)


def load_engine(kind: str, model: str, device: str, engine_args: dict[str, object]) -> DiTLikeEngine | Code2Wav:
    """The engine a Load names, built as the worker's own pool would build it in-process."""
    if kind == "code2wav":
        torchvision_free.install()  # as a worker's engines have it: transformers' Qwen2.5-Omni module loads without it
        return Code2Wav(model, device=device)
    if kind != "dit":
        raise ValueError(f"an engine process runs DiT and code2wav engines, not {kind!r}")
    return build_dit(model, engine_args, device=device)  # type: ignore[arg-type]  # JSON, as it was sent


def code2wav_facts(engine: Code2Wav) -> dict[str, int]:
    """What a worker's Code2WavStream needs of the model, sent with ``Loaded``."""
    return {"block_codes": engine.block_codes, "samples_per_code": engine.samples_per_code,
            "sample_rate": engine.sample_rate, "max_codes": engine.max_codes, "num_codes": engine.num_codes}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the worker's socket pair")
    parser.add_argument("--model", default="", help="the model it serves (shown by ps; the load message names it)")
    args = parser.parse_args(argv)
    apply_engine_library_defaults()  # before torch loads, as in the worker (workers/app.py)

    settings = get_settings()
    configure_logging(settings.log_format, settings.log_level, service="engine")
    tune_engine_malloc(settings.engine_malloc)
    conn = Connection(socket.socket(fileno=args.fd).detach())
    load = to_engine.decode(conn.recv_bytes())
    if not isinstance(load, Load):
        raise SystemExit(f"engine process: expected a load message first, got {type(load).__name__}")
    turns.configure(turns.lock_file(settings.engine_turns, load.device, settings.engine_cpus))
    started = time.perf_counter()
    try:
        engine = load_engine(load.kind, load.model, load.device, load.engine_args)
    except Exception as exc:  # noqa: BLE001 - the worker raises it where it asked for the engine
        conn.send_bytes(encode(Failed(-1, type(exc).__name__, str(exc))))
        return
    pipeline_class = str(getattr(engine, "pipeline_class", type(engine).__name__))
    facts = code2wav_facts(engine) if isinstance(engine, Code2Wav) else {}
    conn.send_bytes(encode(Loaded(os.getpid(), pipeline_class, time.perf_counter() - started, facts)))
    log.info("engine process %d: %s (%s) loaded in %.1f s", os.getpid(), load.model, pipeline_class,
             time.perf_counter() - started)
    if isinstance(engine, Code2Wav):
        EngineServer(conn, code2wav_served(engine)).serve()
    else:
        EngineServer(conn, dit_served(engine), engine).serve()


if __name__ == "__main__":
    main()
