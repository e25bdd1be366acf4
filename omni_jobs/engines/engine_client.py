"""A DiT engine in a process of its own, as the worker sees it: the same engine, behind a socket.

``DiTEngineProcess`` takes DiTRequests and gives DiTOutputs like DiTEngine, behind the same batcher:
progress, previews, cancel (a ``Stop`` once every member of a call stopped) and per-member failures work
as in-process. The worker's threads keep the jobs (leases, inputs, outputs, commits, events); the
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
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np

from omni_jobs import telemetry
from omni_jobs.engines.allocator import engine_process_env
from omni_jobs.engines.dit import DiTOutput, DiTRequest, StepCallback
from omni_jobs.engines.engine_wire import (
    Answered,
    CheckTask,
    Done,
    Failed,
    FromEngine,
    Generate,
    Load,
    Loaded,
    Preview,
    Step,
    Stop,
    Stopped,
    WireDiTOutput,
    WireDiTRequest,
    discard,
    encode,
    from_engine,
    pack,
    remove_blocks,
    unpack,
)
from omni_jobs.json_types import JsonValue
from omni_jobs.previews import LatentPreview, LatentProjection

if TYPE_CHECKING:
    import PIL.Image
    import torch

log = logging.getLogger(__name__)

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

    def send(self, message: Load | CheckTask | Generate | Stop) -> None:
        assert self._conn is not None
        try:
            self._conn.send_bytes(encode(message))
        except OSError as exc:
            raise self._died(exc) from exc

    def receive(self) -> FromEngine:
        """The next message; EngineProcessDied once the process is gone and has nothing more to say."""
        assert self._conn is not None and self._proc is not None
        try:
            while not self._conn.poll(self.poll_s):
                if self._proc.poll() is not None and not self._conn.poll(0):
                    raise self._died(None)
            return from_engine.decode(self._conn.recv_bytes())
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


class DiTEngineProcess:
    """A DiT engine (DiTEngine, or the benchmark's GPU-shaped one) in its own process: DiTLikeEngine."""

    def __init__(self, model: str, engine_args: Mapping[str, JsonValue], *, device: str) -> None:
        self.model = model
        self.process = EngineProcess(Load("dit", model, device, dict(engine_args)))
        self.pipeline_class = self.process.loaded.pipeline_class
        self._lock = threading.RLock()  # one call at a time: the process runs them in order anyway
        self._ids = itertools.count(1)
        self._checked: dict[tuple[str, bool], Exception | None] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    @contextmanager
    def turn(self) -> Iterator[None]:
        """The engine to this thread (a batcher's batch is final once it has it). The engine process
        takes the host's engine turn itself, at each call (omni_jobs.engines.turns)."""
        with self._lock:
            yield

    def check_task(self, task: str, *, conditioned_on_embeds: bool = False) -> None:
        """As DiTEngine.check_task, asked of the process once per task."""
        key = (task, conditioned_on_embeds)
        with self._lock:
            if key not in self._checked:
                call_id = next(self._ids)
                self.process.send(CheckTask(call_id, task, conditioned_on_embeds))
                answer = self.process.receive()
                self._checked[key] = remote_error(answer) if isinstance(answer, Failed) else None
        error = self._checked[key]
        if error is not None:
            raise type(error)(*error.args)

    def generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None = None) -> list[DiTOutput]:
        """As DiTEngine.generate. A call whose process dies runs again on a fresh one, once."""
        if not requests:
            return []
        with self._lock:
            telemetry.batch("dit", len(requests))
            try:
                return self._generate(requests, on_step)
            except EngineProcessDied as died:
                log.warning("%s; starting a fresh one and running its call of %d again", died, len(requests))
                self._restart()
            try:
                return self._generate(requests, on_step)
            except EngineProcessDied as died:
                self._restart()
                raise EngineCrashed(f"{died}, twice on the same call of {len(requests)} requests") from died

    def _restart(self) -> None:
        self.process.restart()
        telemetry.engine_restart("dit")

    def close(self) -> None:
        with self._lock:
            self.process.close()

    def _generate(self, requests: Sequence[DiTRequest], on_step: StepCallback | None) -> list[DiTOutput]:
        call_id = next(self._ids)
        wire, arrays = _wire_requests(requests)
        block = pack(arrays)
        try:
            self.process.send(Generate(call_id, wire, block))
        except EngineProcessDied:
            discard(block)
            raise
        stopped: BaseException | None = None
        while True:
            try:
                message = self.process.receive()
            except EngineProcessDied:
                discard(block)  # unread if it died before taking the call
                raise
            if isinstance(message, Step):
                if stopped is None and on_step is not None:
                    try:
                        on_step(message.done, message.total)
                    except BaseException as exc:  # noqa: BLE001 - raised once the process has stopped
                        stopped = exc
                        self.process.send(Stop(call_id))
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
            elif not isinstance(message, Answered):
                raise TypeError(f"engine process: unexpected {type(message).__name__} during a call")


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
