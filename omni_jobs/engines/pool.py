"""The engine pool: engines loaded once per process and shared by every task that needs them.

Loading an engine costs seconds (vLLM) and memory; a worker keeps each one it has loaded, keyed
by kind, resolved model and engine args, so two stages naming the same model share one engine.
(Not to be confused with the stage-output cache, omni_jobs.stage_cache, or a DiT stage's denoising
cache, ``engine_args.cache``.)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from omni_jobs import telemetry
from omni_jobs.engines.ar import AREngine
from omni_jobs.engines.dit import DiTEngine
from omni_jobs.engines.encoder import AREncoder
from omni_jobs.engines.model_source import resolve_model

E = TypeVar("E")
_DIT_CTOR_KEYS = ("pipeline_class", "torch_dtype", "call_args", "cache")


class EnginePool:
    """Thread-safe pool of AR and DiT engines; a model source's ids (``tiny:NAME``) are resolved, and built, on first use."""

    def __init__(self, models_dir: Path, *, kv_cache_bytes: int, max_model_len: int, device: str) -> None:
        self.models_dir = Path(models_dir)
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.device = device
        self._engines: dict[tuple[str, str, str], Any] = {}
        self._lock = threading.Lock()  # guards the two dicts, never held during a load
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}

    def ar(self, model: str, engine_args: Mapping[str, Any]) -> AREngine:
        """The AR engine for ``model``; ``engine_args`` go to vLLM and override the defaults."""
        args = dict(engine_args)

        def load(resolved: str) -> AREngine:
            return AREngine(
                resolved, engine_args=args, kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len
            )

        return self._get("ar", model, args, load)

    def dit(self, model: str, engine_args: Mapping[str, Any]) -> DiTEngine:
        """The DiT engine for ``model``: ``pipeline_class``, ``torch_dtype``, ``call_args`` configure
        the engine; every other key goes to ``from_pretrained``."""
        args = dict(engine_args)
        ctor = {k: args[k] for k in _DIT_CTOR_KEYS if k in args}
        load_args = {k: v for k, v in args.items() if k not in _DIT_CTOR_KEYS}

        def load(resolved: str) -> DiTEngine:
            return DiTEngine(resolved, device=self.device, load_args=load_args, **ctor)

        return self._get("dit", model, args, load)

    def encoder(self, model: str, engine_args: Mapping[str, Any]) -> AREncoder:
        """The AR encoder (vLLM pooling runner) for ``model``: a separate engine from ``ar()``'s."""
        args = dict(engine_args)

        def load(resolved: str) -> AREncoder:
            return AREncoder(
                resolved, engine_args=args, kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len
            )

        return self._get("ar-encode", model, args, load)

    def loaded(self) -> list[tuple[str, str, str]]:
        """Keys of the engines loaded so far (for health and metrics)."""
        with self._lock:
            return list(self._engines)

    def _get(self, kind: str, model: str, args: dict[str, Any], load: Callable[[str], E]) -> E:
        """Load each key once; a slow load blocks only callers of the same key."""
        resolved = resolve_model(model, self.models_dir)  # a source's build (tiny:) is itself race-safe
        key = (kind, resolved, json.dumps(args, sort_keys=True, default=str))
        with self._lock:
            if key in self._engines:
                telemetry.cache_lookup("engine", hit=True)
                return self._engines[key]  # type: ignore[no-any-return]
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._engines:
                    telemetry.cache_lookup("engine", hit=True)
                    return self._engines[key]  # type: ignore[no-any-return]
            telemetry.cache_lookup("engine", hit=False)
            started = time.perf_counter()
            engine = load(resolved)
            telemetry.engine_load(kind, time.perf_counter() - started)
            with self._lock:
                self._engines[key] = engine
                self._loading.pop(key, None)
            return engine
