"""The stage-output cache on real Redis with real engines: a repeated request skips the stage and
gets byte-identical outputs; fifo and lru evict in their orders; diffusers denoising caches load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from omni_jobs.accept.submission import JobSubmitter
from omni_jobs.artifacts import ArtifactStore, LocalBackend, RedisBackend
from omni_jobs.core import keys
from omni_jobs.core.errors import PipelineSpecError
from omni_jobs.engines.batching import BatchDefaults, dit_batcher
from omni_jobs.jobs.ledger import JobLedger
from omni_jobs.jobs.models import Job
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import AssembleResults, RunStage
from omni_jobs.pipelines.catalogue import PipelineCatalogue, parse_pipeline
from omni_jobs.run.stage_cache import StageOutputCache, cache_key
from omni_jobs.run.stage_outputs import StageCaches
from omni_jobs.run.stage_reports import Reporting
from omni_jobs.run.stages import StageRunner
from tests.outbox import due_steps

CACHED = yaml.safe_load("""
name: cached-image
inputs: {prompt: {type: text}}
stages:
  - id: ar
    engine: ar
    model: tiny:llama
    inputs: {prompt: input.prompt}
    cache: {enabled: true}
    defaults: {max_tokens: 8}
  - id: dit
    engine: dit
    model: tiny:pixart
    inputs: {prompt: ar.text}
    engine_args: {pipeline_class: PixArtSigmaPipeline}
    cache: {enabled: true, max_entries: 10, eviction: lru}
    defaults: {height: 32, width: 32, num_inference_steps: 3, seed: 0}
outputs: [{name: image, from: dit.image}]
""")


@pytest.fixture
def parts(outbox_redis: redis.Redis, tmp_path: Path, engine_cache: Any) -> dict[str, Any]:
    redis_client = outbox_redis  # apart from DB 0 (tests/conftest.py, OUTBOX_DB)
    catalogue = PipelineCatalogue([parse_pipeline(CACHED, source="test")])
    store = RedisJobStore(redis_client, ttl_s=600)
    ledger = JobLedger(store)
    artifacts = ArtifactStore(LocalBackend(tmp_path), RedisBackend(redis_client))
    runner = StageRunner(ledger=ledger, catalogue=catalogue, artifacts=artifacts, engines=engine_cache,
                         reporting=Reporting(progress_interval_s=0), batching=BatchDefaults(wait_ms=0),
                         caches=StageCaches(redis_client))
    stage = catalogue.get("cached-image").stage("dit")
    batcher = dit_batcher(engine_cache.dit(stage.model, stage.engine_args), BatchDefaults(wait_ms=0).policy(stage))
    return {"store": store, "ledger": ledger, "runner": runner, "artifacts": artifacts, "batcher": batcher,
            "submit": JobSubmitter(ledger, catalogue)}


def run_job(parts: dict[str, Any], prompt: str, params: dict[str, Any] | None = None) -> Job:
    """Submit, then run each stage as the outbox dispatches it: a cache hit advances the job like a run."""
    job = parts["submit"].submit("cached-image", {"prompt": prompt}, params)
    for stage in ("ar", "dit"):
        steps = due_steps(parts["store"], job.id)
        assert steps == [RunStage(job.id, stage, 1, stage)]
        assert parts["runner"].run(steps[0], worker="test", owner="test#1").status == "succeeded"
    assert due_steps(parts["store"], job.id) == [AssembleResults(job.id, 1)]
    final: Job = parts["ledger"].require(job.id)
    return final


def stage_bytes(parts: dict[str, Any], job: Job, stage: str) -> dict[str, bytes]:
    return {p: parts["artifacts"].get(r) for p, r in job.stage_record(stage).outputs.items()}


def test_a_repeated_request_skips_its_stages_and_gets_identical_bytes(parts: dict[str, Any]) -> None:
    first = run_job(parts, "a lighthouse at dusk")
    calls = len(parts["batcher"].batches)
    again = run_job(parts, "a lighthouse at dusk")
    assert len(parts["batcher"].batches) == calls, "the DiT engine ran again on a cache hit"
    for stage in ("ar", "dit"):
        assert first.stage_record(stage).metrics["cache_hit"] == 0.0
        assert again.stage_record(stage).metrics["cache_hit"] == 1.0
        assert again.stage_record(stage).metrics["engine_s"] == 0.0
        assert stage_bytes(parts, again, stage) == stage_bytes(parts, first, stage)
    # the hit is stored as the new job's own artifact (of its own attempt), not a pointer into the first job
    for job in (first, again):
        assert job.stage_record("dit").outputs["image"].key == keys.intermediate_artifact(job.id, "dit", "image.png", 1)


def test_another_seed_or_prompt_misses(parts: dict[str, Any]) -> None:
    first = run_job(parts, "a red kite")
    other_seed = run_job(parts, "a red kite", {"dit": {"seed": 7}})
    assert other_seed.stage_record("ar").metrics["cache_hit"] == 1.0  # same AR config and input
    assert other_seed.stage_record("dit").metrics["cache_hit"] == 0.0
    assert stage_bytes(parts, other_seed, "dit") != stage_bytes(parts, first, "dit")
    other_prompt = run_job(parts, "a blue kite")
    assert other_prompt.stage_record("ar").metrics["cache_hit"] == 0.0


def test_previews_do_not_change_the_key_a_hit_skips_them(parts: dict[str, Any]) -> None:
    first = run_job(parts, "a previewed kite", {"dit": {"preview_every": 1}})
    assert [e.data["step"] for e in parts["ledger"].events(first.id) if e.type == "output.preview"] == [1, 2]
    plain = run_job(parts, "a previewed kite")
    assert plain.stage_record("dit").metrics["cache_hit"] == 1.0  # previews leave the outputs as they are
    assert stage_bytes(parts, plain, "dit") == stage_bytes(parts, first, "dit")


def test_sampling_without_a_seed_is_never_cached(parts: dict[str, Any]) -> None:
    job = run_job(parts, "dice", {"ar": {"temperature": 1.0}})
    assert "cache_hit" not in job.stage_record("ar").metrics


@pytest.mark.parametrize(("eviction", "survivors"), [("fifo", ["b", "c"]), ("lru", ["a", "c"])])
def test_eviction_order(redis_client: redis.Redis, eviction: str, survivors: list[str]) -> None:
    cache = StageOutputCache(redis_client, max_entries=2, eviction=eviction)  # type: ignore[arg-type]
    for d in ("a", "b"):
        cache.put("p.s", d, {"out": d.encode()}, {"out": "text/plain"})
    assert cache.get("p.s", "a") is not None  # a use: refreshes "a" under lru only
    evicted = cache.put("p.s", "c", {"out": b"c"}, {"out": "text/plain"})
    assert evicted == (["a"] if eviction == "fifo" else ["b"])
    assert cache.digests("p.s") == survivors
    assert cache.get("p.s", evicted[0]) is None
    hit = cache.get("p.s", survivors[0])
    assert hit is not None and hit.data == {"out": survivors[0].encode()} and hit.media_types == {"out": "text/plain"}
    assert cache.stats() == {"hits": 2, "misses": 1}


def test_key_covers_config_params_and_inputs() -> None:
    base = cache_key({"model": "m"}, {"seed": 1}, {"prompt": "x"})
    assert base == cache_key({"model": "m"}, {"seed": 1}, {"prompt": "x"})
    assert len({base, cache_key({"model": "n"}, {"seed": 1}, {"prompt": "x"}),
                cache_key({"model": "m"}, {"seed": 2}, {"prompt": "x"}),
                cache_key({"model": "m"}, {"seed": 1}, {"prompt": "y"})}) == 4


def test_first_block_denoising_cache_is_selectable_per_stage(engine_cache: Any) -> None:
    from omni_jobs.engines.dit import DiTRequest

    spec = parse_pipeline({**CACHED, "name": "fbc", "stages": [
        CACHED["stages"][0],
        {**CACHED["stages"][1], "engine_args": {"pipeline_class": "PixArtSigmaPipeline",
                                                "cache": {"type": "first_block", "threshold": 0.2}}}]}, source="test")
    stage = spec.stage("dit")
    cached = engine_cache.dit(stage.model, stage.engine_args)
    plain = engine_cache.dit(stage.model, {"pipeline_class": "PixArtSigmaPipeline"})
    assert cached is not plain and cached.cache_type == "first_block" and plain.cache_type is None
    request = DiTRequest("r", prompt="fog", height=32, width=32, num_inference_steps=6, seed=3)
    a, b = cached.generate([request])[0].image, cached.generate([request, request])[0].image
    assert a.size == (32, 32) and a.tobytes() == b.tobytes()  # the cache's state is reset between calls


def test_a_bad_denoising_cache_is_refused_naming_the_field() -> None:
    bad = {**CACHED, "name": "bad", "stages": [
        CACHED["stages"][0], {**CACHED["stages"][1], "engine_args": {"cache": {"type": "magic"}}}]}
    with pytest.raises(PipelineSpecError, match="engine_args.cache.type.*first_block"):
        parse_pipeline(bad, source="test")
