"""The stage-output cache (the vLLM-Omni design's "DiT cache" at stage level): a repeated request skips a stage.

The key is a content hash of what determines a stage's outputs: the stage's config (engine, task,
model, engine args, outputs), the job's resolved parameters for it (seed included) and the sha256
of each input. An entry keeps the encoded output bytes, so a hit stores byte-identical outputs for
the new job without calling the engine. Each scope (pipeline/stage) holds at most ``max_entries``;
a full scope drops its oldest entry (fifo) or its least recently used one (lru). Hits and misses
are counted in Redis (for tests and the benchmark) and reported to telemetry (Prometheus:
``omni_jobs_cache_requests_total{cache="stage"}``). Not the engine pool (engines/pool.py), nor a
DiT stage's denoising cache (``engine_args.cache``, inside the diffusers call).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import redis
from redis.typing import EncodableT

from omni_jobs.core import keys, telemetry
from omni_jobs.core.json_types import JsonValue
from omni_jobs.core.redis_replies import members, text

Eviction = Literal["fifo", "lru"]
_MEDIA = "__media__"
METRIC_NAME = "stage"


@dataclass(frozen=True)
class CachedOutputs:
    """One hit: each output port's bytes and media type."""

    data: dict[str, bytes]
    media_types: dict[str, str]


def _sha(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str, separators=(",", ":")).encode()).hexdigest()


def cache_key(stage_config: Mapping[str, object], params: Mapping[str, object], input_digests: Mapping[str, str]) -> str:
    """The content hash of (stage config, resolved params incl. seed, input sha256s)."""
    return _sha({"stage": dict(stage_config), "params": dict(params), "inputs": dict(input_digests)})


def text_digest(value: JsonValue) -> str:
    """sha256 of a job-input value (text, number, or an uploaded file's reference)."""
    return _sha(value)


class StageOutputCache:
    """Stage outputs in Redis, per scope, bounded with fifo or lru eviction."""

    def __init__(self, client: redis.Redis, *, max_entries: int = 1000, eviction: Eviction = "lru") -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if eviction not in ("fifo", "lru"):
            raise ValueError(f"eviction must be fifo or lru, got {eviction!r}")
        self.redis = client
        self.max_entries = max_entries
        self.eviction: Eviction = eviction
        self.hits = 0
        self.misses = 0

    def get(self, scope: str, digest: str) -> CachedOutputs | None:
        """The cached outputs, or None; a hit refreshes the entry's place under lru."""
        raw = {text(k): v for k, v in self.redis.hgetall(keys.stage_cache_entry(scope, digest)).items()}
        if not raw or _MEDIA not in raw:
            self.misses += 1
            telemetry.cache_lookup(METRIC_NAME, hit=False)
            return None
        self.hits += 1
        telemetry.cache_lookup(METRIC_NAME, hit=True)
        if self.eviction == "lru":
            self.redis.zadd(keys.stage_cache_index(scope), {digest: self.redis.incr(keys.STAGE_CACHE_CLOCK)})
        media = json.loads(raw.pop(_MEDIA))
        data = {k: v for k, v in raw.items() if isinstance(v, bytes)}  # the client does not decode replies
        return CachedOutputs(data=data, media_types=media)

    def put(self, scope: str, digest: str, data: Mapping[str, bytes], media_types: Mapping[str, str]) -> list[str]:
        """Store one result; returns the digests evicted to keep the scope within max_entries."""
        mapping: dict[EncodableT, EncodableT] = {port: value for port, value in data.items()}
        mapping[_MEDIA] = json.dumps(dict(media_types))
        index = keys.stage_cache_index(scope)
        pipe = self.redis.pipeline()
        pipe.hset(keys.stage_cache_entry(scope, digest), mapping=mapping)
        pipe.zadd(index, {digest: self.redis.incr(keys.STAGE_CACHE_CLOCK)}, nx=self.eviction == "fifo")
        pipe.execute()
        evicted: list[str] = []
        excess = int(self.redis.zcard(index)) - self.max_entries
        if excess > 0:
            for entry in self.redis.zpopmin(index, excess):
                name = text(entry[0] if isinstance(entry, tuple | list) else entry)  # (member, score)
                self.redis.delete(keys.stage_cache_entry(scope, name))
                evicted.append(name)
        return evicted

    def digests(self, scope: str) -> list[str]:
        """The scope's digests, next to be evicted first."""
        return members(self.redis.zrange(keys.stage_cache_index(scope), 0, -1))

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}
