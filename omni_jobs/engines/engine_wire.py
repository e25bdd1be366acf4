"""What a worker and its engine process say to each other: typed messages, and arrays in shared memory.

Messages are msgspec structs, msgpack-encoded, one per frame of the socket between the two processes
(omni_jobs.engines.engine_client starts the process, omni_jobs.engines.engine_process serves it).
Arrays and tensors never go through the socket: the sender packs all of a message's arrays into one
POSIX shared-memory block (``pack``) and the message carries their places in it (``ArrayRef``); the
receiver copies them out and unlinks the block (``unpack``). A 32-image batch of 256 px images is 6 MB:
one copy each way instead of pickling it through a pipe.

A block is named after its sender's process id (``omni-eng-<pid>-<n>``), so that the blocks of a
process that died before its peer read them can be found and removed (``remove_blocks``).
"""

from __future__ import annotations

import glob
import itertools
import os
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

BLOCK_PREFIX = "omni-eng"
_sequence = itertools.count()


class ArrayRef(msgspec.Struct, frozen=True):
    """One array of a block: its bytes at ``offset``; ``dtype`` is numpy's name, or ``torch.NAME`` for a
    tensor (any torch dtype, bfloat16 included, goes as its raw bytes)."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class Block(msgspec.Struct, frozen=True):
    """A shared-memory block and the arrays packed in it, in order."""

    name: str
    arrays: tuple[ArrayRef, ...]


def pack(values: Sequence[object]) -> Block | None:
    """``values`` (numpy arrays and torch tensors) in one new shared-memory block; None for no values.

    The block outlives this process's handle: the receiver unlinks it (``unpack``)."""
    if not values:
        return None
    raw = [_raw(v) for v in values]
    refs: list[ArrayRef] = []
    offset = 0
    for data, dtype, shape in raw:
        offset = (offset + 63) // 64 * 64  # each array 64-byte aligned
        refs.append(ArrayRef(offset, int(data.nbytes), dtype, shape))
        offset += int(data.nbytes)
    name = f"{BLOCK_PREFIX}-{os.getpid()}-{next(_sequence)}"
    block = shared_memory.SharedMemory(name=name, create=True, size=max(offset, 1))
    try:
        # Python registers a block with its creator's resource tracker, which would unlink it when this
        # process exits, even while the peer has yet to read it: the receiver owns it from here.
        resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]  # SharedMemory._name is private and untyped
        view = np.frombuffer(_buffer(block), np.uint8)
        for (data, _, _), ref in zip(raw, refs, strict=True):
            view[ref.offset:ref.offset + ref.nbytes] = data
        del view  # no export of the buffer may outlive close()
    finally:
        block.close()
    return Block(name, tuple(refs))


def unpack(block: Block | None) -> list[object]:
    """The block's arrays (numpy arrays; tensors for ``torch.`` dtypes), copied out; the block is unlinked."""
    if block is None:
        return []
    shm = shared_memory.SharedMemory(name=block.name)
    try:
        return [_value(np.frombuffer(_buffer(shm), np.uint8, ref.nbytes, ref.offset).copy(), ref)
                for ref in block.arrays]
    finally:
        shm.close()
        shm.unlink()


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    assert shm.buf is not None  # an open block's
    return shm.buf


def discard(block: Block | None) -> None:
    """Unlink a block that will not be read (its call was answered otherwise, or its reader died)."""
    if block is None:
        return
    try:
        shm = shared_memory.SharedMemory(name=block.name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()


def remove_blocks(pid: int) -> int:
    """Unlink every block that process ``pid`` made and no one read (it died, or its peer did); how many."""
    removed = 0
    for path in glob.glob(f"/dev/shm/{BLOCK_PREFIX}-{pid}-*"):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _raw(value: object) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """The value's bytes (flat uint8), its dtype's name and its shape."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return array.reshape(-1).view(np.uint8), array.dtype.str, tuple(int(n) for n in array.shape)
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        flat = tensor.reshape(-1).view(torch.uint8).numpy()
        return flat, f"torch.{_torch_name(tensor.dtype)}", tuple(int(n) for n in tensor.shape)
    raise TypeError(f"only numpy arrays and torch tensors go through shared memory, got {type(value).__name__}")


def _value(data: np.ndarray, ref: ArrayRef) -> object:
    if not ref.dtype.startswith("torch."):
        return data.view(np.dtype(ref.dtype)).reshape(ref.shape)
    import torch

    dtype = getattr(torch, ref.dtype.removeprefix("torch."))
    return torch.from_numpy(data).view(dtype).reshape(ref.shape)


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the messages ---

class Load(msgspec.Struct, tag="load", frozen=True):
    """The first message: which engine to load (``kind``: ``dit``, the GPU-shaped one included, or ``code2wav``),
    from what, on which device."""

    kind: str
    model: str
    device: str
    engine_args: dict[str, object]


class Loaded(msgspec.Struct, tag="loaded", frozen=True):
    pid: int
    pipeline_class: str
    load_s: float
    facts: dict[str, int] = msgspec.field(default_factory=dict)
    """What the worker needs to know of the model without loading it (code2wav: its codes, windows, samples)."""


class CheckTask(msgspec.Struct, tag="check_task", frozen=True):
    call_id: int
    task: str
    conditioned_on_embeds: bool


class WireDiTRequest(msgspec.Struct, tag="dit", frozen=True):
    """A DiTRequest without its callback: ``prompt_embeds`` and ``image`` are indexes into the call's block."""

    request_id: str
    prompt: str | None
    height: int | None
    width: int | None
    num_inference_steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str | None
    prompt_embeds: int | None
    image: int | None
    strength: float | None
    duration_s: float | None
    want_latents: bool
    num_frames: int | None
    preview_every: int


class WireCode2WavRequest(msgspec.Struct, tag="code2wav", frozen=True):
    """A Code2WavRequest: a few hundred codes at most, so they go in the message itself."""

    request_id: str
    codes: tuple[int, ...]
    speaker: str
    seed: int
    offset: int
    num_steps: int
    guidance_scale: float


class Generate(msgspec.Struct, tag="generate", frozen=True):
    call_id: int
    requests: tuple[WireDiTRequest, ...]
    inputs: Block | None


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """Every member of the running call was canceled: stop it at its next step."""

    call_id: int


class Step(msgspec.Struct, tag="step", frozen=True):
    call_id: int
    done: int
    total: int


class WirePolicy(msgspec.Struct, frozen=True):
    """A stage's BatchPolicy: the engine process keeps a batcher per policy, as a worker does."""

    max_batch_size: int
    wait_ms: float
    idle_release_s: float
    burst_fill: float


class Submit(msgspec.Struct, tag="submit", frozen=True):
    """One request for the engine process's batcher of ``policy``; ``key`` names it in every answer."""

    key: int
    request: WireDiTRequest | WireCode2WavRequest
    policy: WirePolicy
    tenant: str | None
    inputs: Block | None


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """The submitted request ``key`` is no longer wanted: its batch drops it at its next step."""

    key: int


class Started(msgspec.Struct, tag="started", frozen=True):
    """A batch started: its members' keys (what its steps and outcomes are about)."""

    batch_id: int
    keys: tuple[int, ...]
    waited_s: float
    """How long its first member waited for it (the batching window, the fill, the previous batch)."""


class BatchStep(msgspec.Struct, tag="batch_step", frozen=True):
    """A step of a batch: of every member still in it."""

    batch_id: int
    done: int
    total: int


class Preview(msgspec.Struct, tag="preview", frozen=True):
    """One member's latents at a step; the block holds the latents, then the projection's weight and bias.
    ``index``: the request's place in call ``call_id``, or its key where ``call_id`` is 0 (a submitted one)."""

    call_id: int
    index: int
    step: int
    total: int
    width: int
    height: int
    arrays: Block


class WireDiTOutput(msgspec.Struct, frozen=True):
    """A DiTOutput, or a code2wav clip (its ``audio`` and ``sample_rate``): ``image`` (uint8 [h, w, c] of PIL
    mode ``image_mode``), ``audio``, ``latents``, ``video`` are indexes into the answer's block."""

    request_id: str
    image: int | None = None
    image_mode: str | None = None
    audio: int | None = None
    sample_rate: int | None = None
    latents: int | None = None
    video: int | None = None


class Outcome(msgspec.Struct, frozen=True):
    """A member's output, or the error (class name and message) it alone failed with."""

    key: int
    output: WireDiTOutput | None = None
    error: str | None = None
    message: str | None = None


class Outcomes(msgspec.Struct, tag="outcomes", frozen=True):
    """A batch's members, settled (``batch_id`` 0: a request refused before any batch); their arrays in one
    block."""

    batch_id: int
    outcomes: tuple[Outcome, ...]
    arrays: Block | None
    run_s: float = 0.0
    """How long the batch ran (its members retried one by one included)."""


class Done(msgspec.Struct, tag="done", frozen=True):
    call_id: int
    outputs: tuple[WireDiTOutput, ...]
    arrays: Block | None


class Stopped(msgspec.Struct, tag="stopped", frozen=True):
    call_id: int


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """The call (or the load: ``call_id`` -1) raised ``error`` (its class name) with ``message``."""

    call_id: int
    error: str
    message: str


class Answered(msgspec.Struct, tag="answered", frozen=True):
    call_id: int


ToEngine = Load | CheckTask | Generate | Stop | Submit | Cancel
FromEngine = Loaded | Step | Preview | Done | Stopped | Failed | Answered | Started | BatchStep | Outcomes

to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)
encode = msgspec.msgpack.Encoder().encode
