"""The engine pool: engines loaded once per process and shared by every task that needs them.

Loading an engine costs seconds (vLLM) and memory; a worker keeps each one it has loaded, keyed
by kind, resolved model and engine args, so two stages naming the same model share one engine.
(Not to be confused with the stage-output cache, omni_jobs.run.stage_cache, or a DiT stage's denoising
cache, ``engine_args.cache``.)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TypeVar

from omni_jobs.core import telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.engines import omni_speech
from omni_jobs.engines.ar import AREngine
from omni_jobs.engines.code2wav import Code2Wav
from omni_jobs.engines.dit import DiTEngine, resolve_device
from omni_jobs.engines.encoder import AREncoder
from omni_jobs.engines.engine_client import Code2WavProcess, DiTEngineProcess, ProcessEngine
from omni_jobs.engines.gpu_shaped import GpuShapedDiT
from omni_jobs.engines.projection import Projection, load_projection
from omni_jobs.pipelines.model_source import resolve_model
from omni_jobs.pipelines.spec import DiTEngineArgs, GpuShapedArgs, dit_engine_args

Engine = AREngine | DiTEngine | GpuShapedDiT | DiTEngineProcess | AREncoder | Code2Wav | Code2WavProcess
E = TypeVar("E", AREngine, DiTEngine, GpuShapedDiT, DiTEngineProcess, AREncoder, Code2Wav, Code2WavProcess)
EngineProcessChoice = Literal["auto", "on", "off"]
DiTKind = DiTEngine | GpuShapedDiT | DiTEngineProcess
"""What ``EnginePool.dit`` gives: a DiT engine in this process, or one in a process of its own."""
Code2WavKind = Code2Wav | Code2WavProcess
"""What ``EnginePool.code2wav`` gives: token2wav in this process, or in a process of its own."""
V = TypeVar("V", AREngine, AREncoder)
T = TypeVar("T")


class EnginePool:
    """Thread-safe pool of AR and DiT engines; a model source's ids (``tiny:NAME``) are resolved, and built, on first use."""

    def __init__(self, models_dir: Path, *, kv_cache_bytes: int, max_model_len: int, device: str,
                 engine_process: EngineProcessChoice = "off") -> None:
        self.models_dir = Path(models_dir)
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.device = device
        self.engine_process = engine_process
        """Where engines run: DiT and code2wav engines in processes of their own (omni_jobs.engines.engine_client)
        or in this one (``_apart``); AR engines' cores in vLLM's engine-core process or in this one (``_ar_apart``)."""
        self._on_gpu: bool | None = None  # the device resolved, on first need
        self._engines: dict[tuple[str, str, str], Engine] = {}
        self._lock = threading.Lock()  # guards the dicts, never held during a load or a build
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}
        self._resolved: dict[str, str] = {}
        self._projections: dict[tuple[str, str], Projection] = {}

    def ar(self, model: str, engine_args: Mapping[str, JsonValue]) -> AREngine:
        """The AR engine for ``model``; ``engine_args`` go to vLLM and override the defaults. Its core runs in
        vLLM's engine-core process where ``_ar_apart`` says so."""
        args = dict(engine_args)
        apart = self._ar_apart(args)

        def load(resolved: str) -> AREngine:
            return AREngine(resolved, engine_args=args, kv_cache_bytes=self.kv_cache_bytes,
                            max_model_len=self.max_model_len, apart=apart)

        return self._get("ar", model, args, AREngine, load)

    def _ar_apart(self, engine_args: Mapping[str, JsonValue]) -> bool:
        """Whether an AR engine's core runs in vLLM's engine-core process: as ``_apart`` decides for DiT, except
        for the Qwen2.5-Omni talker, whose model class reads its requests' thinker rows from this process's
        model runner (omni_jobs.engines.talker_vllm), so it stays here. On 2 shared CPU cores the core apart made
        0.61 of direct against 0.85 in-process (docs/decisions/vllm-engine-core-in-process.md)."""
        return not omni_speech.is_talker(engine_args) and self._apart_here()

    def dit(self, model: str, engine_args: Mapping[str, JsonValue]) -> DiTKind:
        """The DiT engine for ``model`` (``build_dit``), in a process of its own where ``_apart`` says so.
        ValueError names a malformed argument, before any load or process start."""
        args = dict(engine_args)
        ctor = dit_engine_args(args)
        if self._apart(ctor):
            return self._get("dit", model, args, DiTEngineProcess,
                             lambda resolved: DiTEngineProcess(resolved, args, device=self.device))
        if isinstance(ctor, GpuShapedArgs):
            shaped = ctor
            return self._get("dit", model, args, GpuShapedDiT, lambda _resolved: GpuShapedDiT.from_args(shaped.model_dump()))
        diffusers = ctor
        return self._get("dit", model, args, DiTEngine, lambda resolved: diffusers_engine(resolved, diffusers, self.device))

    def _apart(self, ctor: DiTEngineArgs | GpuShapedArgs) -> bool:
        """Whether a DiT engine runs in a process of its own: ``on``, ``off``, or ``auto``, where it computes on a
        GPU (the benchmark's GPU-shaped engine stands for one). On the CPU each engine process holds its own torch
        and diffusers (310-575 MiB resident for a tiny model) for 1.03x the 32 px DiT's jobs/s; on a GPU's shape
        it made 1.22x (docs/batching.md). The device is resolved once: ``dit`` runs for every DiT stage."""
        if self.engine_process == "auto" and isinstance(ctor, GpuShapedArgs):
            return True
        return self._apart_here()

    def _apart_here(self) -> bool:
        """The setting's rule for an engine that can run apart: ``on``, ``off``, or ``auto``: on a GPU."""
        if self.engine_process != "auto":
            return self.engine_process == "on"
        return self._gpu()

    def _gpu(self) -> bool:
        """Whether this pool's engines compute on a GPU, resolved once."""
        if self._on_gpu is None:
            self._on_gpu = resolve_device(self.device) != "cpu"
        return self._on_gpu

    def code2wav(self, model: str, engine_args: Mapping[str, JsonValue]) -> Code2WavKind:
        """Qwen2.5-Omni's token2wav of the whole checkpoint ``model`` (a ``dit`` stage's ``code2wav`` task), in a
        process of its own where the DiT rule says so (``_apart_here``): its render is a DiT's loop and a
        vocoder, which the worker's threads would hold up on the interpreter's lock as they would a DiT's."""
        if engine_args:
            raise ValueError(f"a code2wav stage takes no engine_args, got {sorted(engine_args)}")
        if self._apart_here():
            return self._get("code2wav", model, {}, Code2WavProcess,
                             lambda resolved: Code2WavProcess(resolved, device=self.device))
        return self._get("code2wav", model, {}, Code2Wav, lambda resolved: Code2Wav(resolved, device=self.device))

    def encoder(self, model: str, engine_args: Mapping[str, JsonValue]) -> AREncoder:
        """The AR encoder (vLLM pooling runner) for ``model``: a separate engine from ``ar()``'s."""
        return self._vllm("ar-encode", AREncoder, model, engine_args)

    def _vllm(self, kind: str, cls: type[V], model: str, engine_args: Mapping[str, JsonValue]) -> V:
        """A vLLM engine of ``cls`` (generate or pooling), with this pool's KV cache and length bounds."""
        args = dict(engine_args)

        def load(resolved: str) -> V:
            return cls(resolved, engine_args=args, kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len)

        return self._get(kind, model, args, cls, load)

    def projection(self, model: str, weight: str) -> Projection:
        """The Linear ``weight`` of the checkpoint ``model``, read once per process."""
        resolved = self._resolve(model)
        with self._lock:
            found = self._projections.get((resolved, weight))
        if found is None:
            found = load_projection(resolved, weight)
            with self._lock:
                self._projections[(resolved, weight)] = found
        return found

    def close(self) -> None:
        """Stop the engine processes this pool started (in-process engines go with the process)."""
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            if isinstance(engine, ProcessEngine | AREngine):
                engine.close()

    def loaded(self) -> list[tuple[str, str, str]]:
        """Keys of the engines loaded so far (for health and metrics)."""
        with self._lock:
            return list(self._engines)

    def _resolve(self, model: str) -> str:
        """The model's path or hub id, once per model. A source's build (tiny:) is race-safe; it runs
        torch, so on a thread that ends with it (``_on_passing_thread``)."""
        with self._lock:
            resolved = self._resolved.get(model)
        if resolved is None:
            resolved = _on_passing_thread(lambda: resolve_model(model, self.models_dir))
            with self._lock:
                self._resolved[model] = resolved
        return resolved

    def _get(self, kind: str, model: str, args: dict[str, JsonValue], cls: type[E], load: Callable[[str], E]) -> E:
        """Load each key once; a slow load blocks only callers of the same key (``cls``: what ``kind`` loads)."""
        resolved = self._resolve(model)
        key = (kind, resolved, json.dumps(args, sort_keys=True, default=str))
        with self._lock:
            found = self._engines.get(key)
            if isinstance(found, cls):
                telemetry.cache_lookup("engine", hit=True)
                return found
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                found = self._engines.get(key)
                if isinstance(found, cls):
                    telemetry.cache_lookup("engine", hit=True)
                    return found
            telemetry.cache_lookup("engine", hit=False)
            started = time.perf_counter()
            engine = _on_passing_thread(lambda: load(resolved))
            telemetry.engine_load(kind, time.perf_counter() - started)
            with self._lock:
                self._engines[key] = engine
                self._loading.pop(key, None)
            return engine


def build_dit(model: str, engine_args: Mapping[str, JsonValue], *, device: str) -> DiTEngine | GpuShapedDiT:
    """The DiT engine ``engine_args`` configure for the model at ``model``: a diffusers pipeline
    (``diffusers_engine``), or where they name ``kind: gpu-shaped``, the benchmark's GPU-shaped engine
    (GpuShapedArgs; ``model`` is only its name). An engine process builds its engine here."""
    ctor = dit_engine_args(dict(engine_args))
    if isinstance(ctor, GpuShapedArgs):
        return GpuShapedDiT.from_args(ctor.model_dump())
    return diffusers_engine(model, ctor, device)


def diffusers_engine(model: str, ctor: DiTEngineArgs, device: str) -> DiTEngine:
    """``pipeline_class``, ``torch_dtype``, ``call_args`` and ``cache`` configure the engine; every other key
    goes to ``from_pretrained``."""
    return DiTEngine(model, device=device, pipeline_class=ctor.pipeline_class, torch_dtype=ctor.torch_dtype,
                     call_args=ctor.call_args, cache=ctor.cache.model_dump() if ctor.cache is not None else None,
                     load_args=ctor.model_extra)


def _on_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that exits afterwards, taking along the OpenMP team that its torch
    work made.

    PyTorch's CPU kernels run on an OpenMP team owned by the calling thread; a thread keeps its team
    (helper threads, asleep) as long as it lives. libgomp lets a waiting thread spin only while all
    teams' threads together fit on the CPUs; past that, every barrier of every op sleeps in the
    kernel. A worker that loaded its engines on the main thread (the preload) and ran them on a
    batcher's thread had two teams or more: on 2 cores each engine step took ~1.2x as long for the
    same CPU (the engine thread switched out ~11,700 times per bench repetition instead of ~1,100).
    Loading here leaves one team per thread that runs an engine (docs/decisions/one-openmp-team.md; the
    spin-wait that a lone team then gets is bounded in omni_jobs.engines.library_env)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-engine-load") as one:
        return one.submit(fn).result()
