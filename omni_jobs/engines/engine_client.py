"""An engine in a process of its own, as the worker sees it: the same engine, behind a socket.

``DiTEngineProcess`` takes DiTRequests and gives DiTOutputs like DiTEngine, behind the same batcher:
progress, previews, cancel (a ``Stop`` once every member of a call stopped) and per-member failures work
as in-process. ``Code2WavProcess`` does the same for Qwen2.5-Omni's token2wav (Code2WavRequests in, clips
out); both share ``ProcessEngine``, which submits, reads answers and restarts a crashed process. The worker's threads keep the jobs (leases, inputs, outputs, commits, events); the
engine process (omni_jobs.engines.engine_process) holds the model and runs its steps with an
interpreter of its own. Arrays go through shared memory (omni_jobs.engines.engine_wire).

A crashed engine process is started again and the call it was running is sent again, once: a call
that crashes a fresh process too fails with ``EngineCrashed`` (the batcher then runs its members one
by one, so one request that crashes the engine fails alone).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np
from msgspec.structs import replace

from omni_jobs.core import telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines.allocator import engine_process_env
from omni_jobs.engines.batching import BatchPolicy, ProgressFn, current_tenant
from omni_jobs.engines.code2wav import Code2WavFront, Code2WavRequest
from omni_jobs.engines.dit import DiTOutput, DiTRequest, StepCallback
from omni_jobs.engines.engine_wire import (
    BatchStep,
    Cancel,
    CheckTask,
    Done,
    Failed,
    FromEngine,
    Generate,
    Load,
    Loaded,
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
    discard,
    encode,
    from_engine,
    pack,
    remove_blocks,
    unpack,
)
from omni_jobs.media.payloads import AudioClip
from omni_jobs.media.previews import LatentPreview, LatentProjection

if TYPE_CHECKING:
    import PIL.Image
    import torch

log = logging.getLogger(__name__)
R = TypeVar("R")
O = TypeVar("O")

_ERRORS: dict[str, type[Exception]] = {e.__name__: e for e in (
    ValueError, TypeError, RuntimeError, KeyError, NotImplementedError, OSError, FileNotFoundError, MemoryError)}
"""Errors an engine raises for a request (a size it cannot make, a task it cannot run) keep their class."""


class EngineProcessDied(RuntimeError):
    """The engine process exited, or its socket broke, before it answered."""


class EngineCrashed(RuntimeError):
    """A call crashed its engine process, and then a fresh one too."""


def remote_error(failed: Failed) -> Exception:
    """The engine's exception, as the worker raises it (the class kept where callers tell them apart)."""
    cls = _ERRORS.get(failed.error)
    return cls(failed.message) if cls is not None else RuntimeError(f"{failed.error}: {failed.message}")


class EngineProcess:
    """One engine process, started and loaded; ``restart`` replaces it with a fresh one."""

    def __init__(self, load: Load, *, poll_s: float = 1.0) -> None:
        self.load = load
        self.poll_s = poll_s
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.loaded = self._start()

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def _start(self) -> Loaded:
        ours, theirs = socket.socketpair()
        try:
            env = engine_process_env(dict(os.environ))
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "omni_jobs.engines.engine_process", "--fd", str(theirs.fileno()),
                 "--model", self.load.model],  # for ps and for operators: which engine this process holds
                pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self.send(self.load)
        answer = self.receive()
        if isinstance(answer, Failed):
            self.close()
            raise remote_error(answer)
        if not isinstance(answer, Loaded):
            self.close()
            raise EngineProcessDied(f"engine process answered its load with {type(answer).__name__}")
        return answer

    def send(self, message: Load | ToEngine) -> None:
        conn = self._conn
        try:
            if conn is None:
                raise OSError("the engine process was closed")
            conn.send_bytes(encode(message))
        except OSError as exc:
            raise self._died(exc) from exc

    def receive(self) -> FromEngine:
        """The next message; EngineProcessDied once the process is gone and has nothing more to say."""
        conn, proc = self._conn, self._proc
        assert proc is not None
        try:
            if conn is None:
                raise OSError("the engine process was closed")
            while not conn.poll(self.poll_s):
                if proc.poll() is not None and not conn.poll(0):
                    raise self._died(None)
            return from_engine.decode(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._died(exc) from exc

    def _died(self, cause: BaseException | None) -> EngineProcessDied:
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exited with {code}" if code is not None else f"stopped answering ({cause})"
        return EngineProcessDied(f"engine process {self._proc.pid} ({self.load.model}) {how}")

    def restart(self) -> None:
        """A fresh process in place of this one (killed if still there); its unread blocks removed."""
        old = self._proc
        self.close()
        if old is not None:
            remove_blocks(old.pid)
        self.restarts += 1
        started = time.perf_counter()
        self.loaded = self._start()
        log.warning("engine process for %s restarted (%d so far): pid %d, loaded in %.1f s", self.load.model,
                    self.restarts, self.pid, time.perf_counter() - started)

    def close(self) -> None:
        """Stop the process (it exits when its socket closes; killed if it does not within 5 s)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class _Submitted(Generic[R, O]):
    """A request submitted to the engine process's batcher: what the worker waits on, and what a fresh
    process is sent again."""

    def __init__(self, request: R, message: Submit, arrays: list[object], progress: ProgressFn | None) -> None:
        self.request = request
        self.message = message
        self.arrays = arrays
        self.progress = progress
        self.crashes = 0
        self.sent_to = -1  # the process generation (its restarts) it was last sent to
        self.stopped: BaseException | None = None  # its progress raised: canceled by its worker
        self.output: O | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def settle(self, output: O | None, error: BaseException | None) -> None:
        self.output, self.error = output, self.stopped or error
        self.done.set()

    def result(self) -> O:
        """Block until answered: the output, or the request's own error raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output


class ProcessEngine(Generic[R, O]):
    """An engine of some kind (``Load.kind``) in its own process, that stages submit requests to
    (``batcher(policy).submit``): the process batches them, as the worker's batcher would, and answers each.
    One reader thread here takes every answer and hands it on: steps to the members' progress, previews to
    their callbacks, outcomes to the threads that wait for them, a direct call's answers to its caller. A kind
    says how its requests and outputs go over the wire (``_wire``, ``_output``); the rest is shared."""

    kind = "engine"
    """Its engine kind, for telemetry."""

    def __init__(self, load: Load) -> None:
        self.model = load.model
        self.process = EngineProcess(load)
        self.batches: list[int] = []
        """Sizes of the process's batches so far (the last 1000), for tests and the benchmark."""
        self._io = threading.RLock()  # sends, and a restart: a send waits for the fresh process
        self._lock = threading.Lock()  # the tables below
        self._ids = itertools.count(1)
        self._submitted: dict[int, _Submitted[R, O]] = {}
        self._members: dict[int, tuple[int, ...]] = {}  # running batch -> its members' keys
        self._waited: dict[int, float] = {}  # a running batch -> how long its first member waited for it
        self._calls: dict[int, queue.SimpleQueue[FromEngine | EngineProcessDied]] = {}
        self._closed = False
        self._broken: BaseException | None = None  # the process could not be started again: why
        self._reader = threading.Thread(target=self._read, name=f"engine-{self.process.pid}-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def submit(self, request: R, policy: BatchPolicy, progress: ProgressFn | None = None) -> O:
        """Block until the process's batcher of ``policy`` has run this request; its output or its own error.
        A ``progress`` that raises cancels this request alone, and that error is raised."""
        return self._enqueue(request, policy, progress).result()

    def _enqueue(self, request: R, policy: BatchPolicy, progress: ProgressFn | None) -> _Submitted[R, O]:
        wire, arrays = self._wire(request)
        key = next(self._ids)
        message = Submit(key, wire, WirePolicy(policy.max_batch_size, policy.wait_ms, policy.idle_release_s,
                                               policy.burst_fill), current_tenant(), None)
        submitted: _Submitted[R, O] = _Submitted(request, message, arrays, progress)
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._submitted[key] = submitted
        self._send_submitted(submitted)
        return submitted

    def close(self) -> None:
        """Stop the process; requests still waiting fail."""
        self._closed = True
        with self._io:
            self.process.close()
        self._reader.join(timeout=10)
        self._fail_all(RuntimeError(f"the engine process for {self.model} was closed"))

    # --- sending ---
    def _send_submitted(self, submitted: _Submitted[R, O]) -> None:
        """Its request, its arrays in a new block (the process unlinks it once read); once to each process."""
        with self._io:
            generation = self.process.restarts
            if submitted.sent_to == generation:
                return
            block = pack(submitted.arrays)
            try:
                self.process.send(replace(submitted.message, inputs=block))
                submitted.sent_to = generation
            except EngineProcessDied:
                discard(block)  # the reader restarts the process and sends every waiting request again

    def _call(self, message: Callable[[int], CheckTask | Generate]) -> queue.SimpleQueue[FromEngine | EngineProcessDied]:
        call_id = next(self._ids)
        answers: queue.SimpleQueue[FromEngine | EngineProcessDied] = queue.SimpleQueue()
        with self._lock:
            self._calls[call_id] = answers
        try:
            with self._io:
                self.process.send(message(call_id))
        except EngineProcessDied as died:
            answers.put(died)
        return answers

    # --- the reader ---
    def _read(self) -> None:
        while not self._closed:
            try:
                message = self.process.receive()
            except EngineProcessDied as died:
                if self._closed:
                    return
                self._recover(died)
                continue
            try:
                self._route(message)
            except Exception:
                log.exception("engine process %d: handling its %s failed", self.pid, type(message).__name__)

    def _route(self, message: FromEngine) -> None:
        if isinstance(message, Started):
            with self._lock:
                self._members[message.batch_id] = message.keys
            self.batches = [*self.batches[-999:], len(message.keys)]
            telemetry.batch(self.kind, len(message.keys))
            self._waited[message.batch_id] = message.waited_s
        elif isinstance(message, BatchStep):
            self._step(message)
        elif isinstance(message, Outcomes):
            self._settle(message)
        elif isinstance(message, Preview) and message.call_id == 0:
            with self._lock:
                submitted = self._submitted.get(message.index)
            if submitted is not None:
                self._preview(submitted.request, message)
            else:
                discard(message.arrays)
        else:
            call_id = getattr(message, "call_id", None)
            with self._lock:
                answers = self._calls.get(call_id) if isinstance(call_id, int) else None
            if answers is None:
                raise TypeError(f"an answer to no call: {message!r}"[:300])
            answers.put(message)

    def _step(self, step: BatchStep) -> None:
        """A batch's step is a step of each member still in it; a member whose progress raises is canceled."""
        with self._lock:
            keys = self._members.get(step.batch_id, ())
            members = [(k, self._submitted.get(k)) for k in keys]
        for key, submitted in members:
            if submitted is None or submitted.stopped is not None or submitted.progress is None:
                continue
            try:
                submitted.progress(step.done, step.total)
            except BaseException as exc:  # noqa: BLE001 - this member's own error, raised to its caller
                submitted.stopped = exc
                with self._io:
                    self.process.send(Cancel(key))

    def _settle(self, outcomes: Outcomes) -> None:
        arrays = unpack(outcomes.arrays)
        if outcomes.batch_id:
            telemetry.batch_ran(self.kind, self._waited.pop(outcomes.batch_id, 0.0), outcomes.run_s)
            if len(self._waited) > 64:  # the retries of a failed batch start batches of their own, unanswered
                self._waited = {b: w for b, w in self._waited.items() if b > outcomes.batch_id - 64}
        settled = []
        with self._lock:
            for outcome in outcomes.outcomes:
                submitted = self._submitted.pop(outcome.key, None)
                if submitted is not None:
                    settled.append((submitted, outcome))
            finished = set(self._submitted)
            self._members = {b: keys for b, keys in self._members.items() if finished.intersection(keys)}
        for submitted, outcome in settled:
            if outcome.output is not None:
                submitted.settle(self._output(outcome.output, arrays), None)
            else:
                submitted.settle(None, remote_error(Failed(outcome.key, outcome.error or "RuntimeError",
                                                           outcome.message or "")))

    def _recover(self, died: EngineProcessDied) -> None:
        """A fresh process; the requests that were waiting or running are sent to it again, and a request in
        flight through two crashes fails with EngineCrashed. Direct calls hear of the death and retry."""
        log.warning("%s; starting a fresh one", died)
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
            self._members = {}
        for answers in calls:
            answers.put(died)
        with self._io:
            dead = self.process.restarts
            try:
                self.process.restart()
            except Exception as exc:  # the model no longer loads: every waiting request fails with why
                log.exception("engine process for %s could not be started again", self.model)
                with self._lock:
                    self._broken = exc
                self._closed = True
                self._fail_all(exc)
                return
            telemetry.engine_restart(self.kind)
            with self._lock:  # taken with the new process up: a submit racing the crash is among them
                waiting = list(self._submitted.items())
            for key, submitted in waiting:
                if submitted.sent_to == dead:
                    submitted.crashes += 1
                if submitted.crashes >= 2:
                    with self._lock:
                        self._submitted.pop(key, None)
                    submitted.settle(None, EngineCrashed(f"{died}, the second engine process crash with request "
                                                         f"{submitted.message.request.request_id!r} in it"))
                else:
                    self._send_submitted(submitted)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiting, self._submitted = list(self._submitted.values()), {}
        for submitted in waiting:
            submitted.settle(None, error)

    # --- what a kind says ---
    def _wire(self, request: R) -> tuple[WireDiTRequest | WireCode2WavRequest, list[object]]:
        """The request as the wire carries it, and its arrays (for its block)."""
        raise NotImplementedError

    def _output(self, wire: WireDiTOutput, arrays: Sequence[object]) -> O:
        raise NotImplementedError

    def _preview(self, request: R, preview: Preview) -> None:
        discard(preview.arrays)


class Submitter(Generic[R, O]):
    """The batcher of a stage policy, for an engine in a process of its own: ``submit`` as ``Batcher.submit``;
    the batching happens in the engine process."""

    def __init__(self, engine: ProcessEngine[R, O], policy: BatchPolicy) -> None:
        self.engine = engine
        self.policy = policy

    @property
    def batches(self) -> list[int]:
        return self.engine.batches

    def submit(self, request: R, progress: ProgressFn | None = None) -> O:
        return self.engine.submit(request, self.policy, progress)


class ProcessBatcher(Submitter[DiTRequest, DiTOutput]):
    """A DiT engine process's (``dit_batcher``'s counterpart)."""


class DiTEngineProcess(ProcessEngine[DiTRequest, DiTOutput]):
    """A DiT engine (DiTEngine, or the benchmark's GPU-shaped one) in its own process: DiTLikeEngine.

    Stage workers submit requests (``batcher(policy).submit``); direct calls (``generate``, ``check_task``) wait
    for their own answers. Progress, previews, cancel and per-member failures work as in-process."""

    kind = "dit"

    def __init__(self, model: str, engine_args: Mapping[str, JsonValue], *, device: str) -> None:
        super().__init__(Load("dit", model, device, dict(engine_args)))
        self.pipeline_class = self.process.loaded.pipeline_class
        self._checked: dict[tuple[str, bool], Exception | None] = {}
        self._batchers: dict[BatchPolicy, ProcessBatcher] = {}

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Nothing to wait for here: the engine process takes the engine, and the host's engine turn, itself."""
        yield

    def batcher(self, policy: BatchPolicy) -> ProcessBatcher:
        """What a stage submits to, as ``dit_batcher(engine, policy)`` for an engine in this process."""
        with self._lock:
            return self._batchers.setdefault(policy, ProcessBatcher(self, policy))

    def check_task(self, task: str, *, conditioned_on_embeds: bool = False) -> None:
        """As DiTEngine.check_task, asked of the process once per task."""
        key = (task, conditioned_on_embeds)
        if key not in self._checked:
            answers = self._call(lambda call_id: CheckTask(call_id, task, conditioned_on_embeds))
            answer = answers.get()
            if isinstance(answer, EngineProcessDied):
                raise answer
            self._checked[key] = remote_error(answer) if isinstance(answer, Failed) else None
        error = self._checked[key]
        if error is not None:
            raise type(error)(*error.args)

    def generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None = None) -> list[DiTOutput]:
        """As DiTEngine.generate: one direct call, unbatched. A call whose process dies runs again on a fresh one,
        once."""
        if not requests:
            return []
        telemetry.batch("dit", len(requests))
        try:
            return self._generate(requests, on_step)
        except EngineProcessDied as died:
            log.warning("%s; running its call of %d again on a fresh one", died, len(requests))
        try:
            return self._generate(requests, on_step)
        except EngineProcessDied as died:
            raise EngineCrashed(f"{died}, twice on the same call of {len(requests)} requests") from died

    def _generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None) -> list[DiTOutput]:
        wire, arrays = _wire_requests(requests)
        block = pack(arrays)
        answers = self._call(lambda call_id: Generate(call_id, wire, block))
        stopped: BaseException | None = None
        try:
            while True:
                message = answers.get()
                if isinstance(message, EngineProcessDied):
                    discard(block)  # unread if it died before taking the call
                    raise message
                if isinstance(message, Step):
                    if stopped is None and on_step is not None:
                        try:
                            on_step(message.done, message.total)
                        except BaseException as exc:  # noqa: BLE001 - raised once the process has stopped
                            stopped = exc
                            with self._io:
                                self.process.send(Stop(message.call_id))
                elif isinstance(message, Preview):
                    _hand_preview(requests[message.index], message)
                elif isinstance(message, Done):
                    outputs = _outputs(message.outputs, unpack(message.arrays))
                    if stopped is not None:
                        raise stopped
                    return outputs
                elif isinstance(message, Stopped):
                    raise stopped if stopped is not None else RuntimeError("engine process stopped a call unasked")
                elif isinstance(message, Failed):
                    raise remote_error(message)
                else:
                    raise TypeError(f"engine process: unexpected {type(message).__name__} during a call")
        finally:
            with self._lock:
                self._calls = {k: v for k, v in self._calls.items() if v is not answers}

    def _wire(self, request: DiTRequest) -> tuple[WireDiTRequest, list[object]]:
        wire, arrays = _wire_requests([request])
        return wire[0], arrays

    def _output(self, wire: WireDiTOutput, arrays: Sequence[object]) -> DiTOutput:
        return _outputs([wire], arrays)[0]

    def _preview(self, request: DiTRequest, preview: Preview) -> None:
        _hand_preview(request, preview)


class Code2WavProcess(ProcessEngine[Code2WavRequest, AudioClip], Code2WavFront):
    """Qwen2.5-Omni's token2wav in its own process: the process holds the model and runs its batcher (the stage
    policy's, streams' first windows first); the worker keeps the jobs and ``Code2WavStream``'s windowing. The
    model's numbers come with its load; its voices are read here, from the checkpoint, as in-process."""

    kind = "code2wav"

    def __init__(self, model: str, *, device: str) -> None:
        super().__init__(Load("code2wav", model, device, {}))
        facts = self.process.loaded.facts
        self.model_dir = model
        self.block_codes, self.num_codes = facts["block_codes"], facts["num_codes"]
        self.samples_per_code, self.sample_rate = facts["samples_per_code"], facts["sample_rate"]
        self.max_codes = facts["max_codes"]
        self._batchers: dict[BatchPolicy, Submitter[Code2WavRequest, AudioClip]] = {}

    def batcher(self, policy: BatchPolicy) -> Submitter[Code2WavRequest, AudioClip]:
        with self._lock:
            return self._batchers.setdefault(policy, Submitter(self, policy))

    def render(self, requests: Sequence[Code2WavRequest]) -> list[AudioClip]:
        """A direct render, through the process's batcher (one batch a length and voice, as in-process)."""
        for r in requests:
            self.check_codes(r.codes)
        policy = BatchPolicy(max_batch_size=max(1, len(requests)), wait_ms=_RENDER_WAIT_MS)
        waiting = [self._enqueue(r, policy, None) for r in requests]
        return [w.result() for w in waiting]

    def _wire(self, request: Code2WavRequest) -> tuple[WireCode2WavRequest, list[object]]:
        return WireCode2WavRequest(request.request_id, tuple(request.codes), request.speaker, request.seed,
                                   request.offset, request.num_steps, request.guidance_scale), []

    def _output(self, wire: WireDiTOutput, arrays: Sequence[object]) -> AudioClip:
        samples = arrays[wire.audio] if wire.audio is not None else None
        assert isinstance(samples, np.ndarray) and wire.sample_rate is not None
        return AudioClip(samples, wire.sample_rate)


_RENDER_WAIT_MS = 2.0
"""How long a direct render's first request waits for the rest of its call to arrive at the process."""


def _wire_requests(requests: Sequence[DiTRequest]) -> tuple[tuple[WireDiTRequest, ...], list[object]]:
    arrays: list[object] = []

    def put(value: object) -> int:
        arrays.append(value)
        return len(arrays) - 1

    wire = tuple(WireDiTRequest(
        request_id=r.request_id, prompt=r.prompt, height=r.height, width=r.width,
        num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale, seed=r.seed,
        negative_prompt=r.negative_prompt,
        prompt_embeds=put(r.prompt_embeds) if r.prompt_embeds is not None else None,
        image=put(np.asarray(r.image.convert("RGB"))) if r.image is not None else None,
        strength=r.strength, duration_s=r.duration_s, want_latents=r.want_latents, num_frames=r.num_frames,
        preview_every=r.preview_every if r.on_preview is not None else 0,
    ) for r in requests)
    return wire, arrays


def _hand_preview(request: DiTRequest, preview: Preview) -> None:
    """A member's preview to its ``on_preview`` (a preview never fails a generation: DiTEngine's rule)."""
    latents, weight, bias = unpack(preview.arrays)
    if request.on_preview is None:
        return
    assert isinstance(latents, np.ndarray) and isinstance(weight, np.ndarray) and isinstance(bias, np.ndarray)
    try:
        request.on_preview(LatentPreview(latents, LatentProjection(weight, bias), preview.step, preview.total,
                                         preview.width, preview.height))
    except Exception:
        log.warning("request %s: preview at step %d failed", request.request_id, preview.step, exc_info=True)


def _outputs(wire: Sequence[WireDiTOutput], arrays: Sequence[object]) -> list[DiTOutput]:
    def at(index: int | None) -> object:
        return arrays[index] if index is not None else None

    return [DiTOutput(w.request_id, image=_image(at(w.image), w.image_mode), audio=_array(at(w.audio)),
                      sample_rate=w.sample_rate, latents=_tensor(at(w.latents)), video=_array(at(w.video)))
            for w in wire]


def _image(pixels: object, mode: str | None) -> PIL.Image.Image | None:
    if pixels is None:
        return None
    from PIL import Image

    assert isinstance(pixels, np.ndarray)
    image = Image.fromarray(pixels)  # [h, w, 3] is RGB, [h, w, 4] RGBA, [h, w] L
    return image if mode is None or image.mode == mode else image.convert(mode)


def _array(value: object) -> np.ndarray | None:
    assert value is None or isinstance(value, np.ndarray)
    return value


def _tensor(value: object) -> torch.Tensor | None:
    return value  # type: ignore[return-value]  # a tensor: the engine packed it as one
