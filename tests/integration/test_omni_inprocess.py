"""omni_jobs.Omni / AsyncOmni: whole pipelines in this process on the real engines, no broker, no Redis."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from PIL import Image

import omni_jobs
from omni_jobs.artifacts import ArtifactRef, ArtifactStore, ArtifactStoreUnavailable, LocalBackend
from omni_jobs.core.errors import InvalidRequest
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.scheduling import Scheduler
from omni_jobs.engines.pool import EnginePool
from omni_jobs.jobs.memory import MemoryJobStore
from omni_jobs.jobs.models import EventType, JobEvent, StageStatus, now
from omni_jobs.local.tiny import ensure_tiny_model
from omni_jobs.omni import AsyncOmni, Omni, OmniJobFailed, OmniResult
from omni_jobs.pipelines.catalogue import parse_pipeline

MODELS = Path(__file__).resolve().parents[2] / "var" / "models"


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(models_dir=MODELS, artifacts_dir=tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def engines(settings: Settings) -> EnginePool:
    return EnginePool(MODELS, kv_cache_bytes=settings.ar_kv_cache_bytes, max_model_len=settings.ar_max_model_len,
                       device="cpu")


@pytest.fixture(scope="module")
def store() -> MemoryJobStore:
    return MemoryJobStore()


def omni(pipeline: object, settings: Settings, engines: EnginePool, store: MemoryJobStore) -> Omni:
    return Omni(pipeline, settings=settings, engines=engines, store=store)  # type: ignore[arg-type]


def assert_settled(store: MemoryJobStore, job_id: str) -> None:
    """A finished in-process job leaves nothing behind: no lease, nothing (even delayed) in the outbox."""
    assert not [s for s in store.leased_slots() if job_id in s]
    Scheduler(store, None).release_all()  # first attempts wait for their turn
    assert store.claim_outbox(now=now() + 3600, limit=10, hold_s=1.0, job_id=job_id) == []


def test_package_level_api_runs_text_to_image(settings: Settings, engines: EnginePool, store: MemoryJobStore) -> None:
    events: list[JobEvent] = []
    runner = omni_jobs.Omni("text-to-image", settings=settings, engines=engines, store=store)
    result = runner.generate({"prompt": "a red fox"}, {"dit": {"height": 32, "width": 48, "num_inference_steps": 3}},
                             on_event=events.append)
    assert isinstance(result, OmniResult) and result.job.status.value == "succeeded"
    assert result.job.params["dit"]["num_inference_steps"] == 3 and result.job.params["dit"]["guidance_scale"] == 4.5
    image = result["image"].image()
    assert image.size == (48, 32) and image.mode == "RGB"
    assert result["image"].entry.width == 48 and result["text"].text is not None
    assert [s.worker for s in result.job.stages] == [runner.worker] * 2
    assert [s.attempts for s in result.job.stages] == [1, 1]
    types = [e.type for e in events]
    assert types[0] == "job.queued" and types[-1] == "job.succeeded"
    assert [(e.type, e.data["stage"]) for e in events if e.type in ("stage.started", "stage.succeeded")] == [
        ("stage.started", "ar"), ("stage.succeeded", "ar"), ("stage.started", "dit"), ("stage.succeeded", "dit")]
    assert_settled(store, result.job.id)
    steps = [e.data["step"] for e in events if e.type == "stage.progress" and e.data["stage"] == "dit"]
    assert steps and steps[-1] == 3  # diffusion progress reached the last step
    # The files are where the job's record says: under its outputs (a results step's attempt has keys of its own).
    key = result["image"].entry.artifact.key
    assert key.startswith(f"jobs/{result.job.id}/outputs/") and key.endswith("/image.png")
    assert (settings.artifacts_dir / key).read_bytes() == result["image"].data


def test_llm_conditioned_image_and_latents(settings: Settings, engines: EnginePool, store: MemoryJobStore) -> None:
    result = omni("llm-conditioned-image", settings, engines, store).generate({"prompt": "a lighthouse"})
    assert result["image"].image().size == (32, 32)
    latents = result["latents"].tensor()
    assert list(latents.shape) == result["latents"].entry.shape == [4, 8, 8]
    encoder = result.job.stage_record("encoder")
    assert encoder.outputs["hidden_states"].media_type == "application/vnd.safetensors"


def test_image_inputs_in_process(settings: Settings, engines: EnginePool, store: MemoryJobStore,
                                 tmp_path: Path) -> None:
    source = omni("text-to-image", settings, engines, store).generate(
        {"prompt": "a boat"}, {"dit": {"height": 32, "width": 32, "num_inference_steps": 2}})
    edit = omni("image-to-image", settings, engines, store)
    by_ref = edit.generate({"prompt": "make it red", "image": {"job_id": source.job.id, "output": "image"}})
    by_pil = edit.generate({"prompt": "make it red", "image": source["image"].image()})
    path = tmp_path / "in.png"
    path.write_bytes(source["image"].data)
    by_path = edit.generate({"prompt": "make it red", "image": path})
    assert by_ref["image"].data == by_pil["image"].data == by_path["image"].data
    assert by_ref["image"].image().size == (32, 32)
    assert by_ref.job.input["image"]["artifact"]["sha256"] == source["image"].entry.artifact.sha256


def test_bad_request_and_failing_stage(settings: Settings, engines: EnginePool, store: MemoryJobStore,
                                       tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        omni("text-to-audio", settings, engines, store).generate({"prompt": "x"}, {"audio": {"duration_s": 0}})
    assert info.value.errors[0].loc == ("params", "audio", "duration_s")

    broken = yaml.safe_load("""
name: wrong-engine
inputs: {prompt: {type: text}}
stages:
  - {id: sound, engine: dit, task: text-to-audio, model: tiny:pixart, inputs: {prompt: input.prompt}}
outputs: [{name: audio, from: sound.audio}]
""")
    path = tmp_path / "wrong-engine.yaml"
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(OmniJobFailed) as failed:
        omni(path, settings, engines, store).generate({"prompt": "x"})
    job = failed.value.job
    assert job.status.value == "failed" and job.error is not None and job.error.stage == "sound"
    assert "does not make audio" in job.error.message and "StableAudioPipeline" in job.error.message
    assert job.stage_record("sound").attempts == 1  # a stage error is final: not retried
    assert_settled(store, job.id)


def test_embedding_size_mismatch_found_at_load(settings: Settings, engines: EnginePool, store: MemoryJobStore,
                                               tmp_path: Path) -> None:
    """A DiT the spec cannot inspect (not on disk when validated): the size check happens at run time."""
    later = tmp_path / "dit-appears-later"
    spec = parse_pipeline(yaml.safe_load(f"""
name: mismatch
inputs: {{prompt: {{type: text}}}}
stages:
  - {{id: enc, engine: ar, task: encode, model: tiny:llama, inputs: {{prompt: input.prompt}}}}
  - {{id: dit, engine: dit, model: {later}, inputs: {{prompt_embeds: enc.hidden_states}},
     defaults: {{height: 32, width: 32, num_inference_steps: 2}}}}
outputs: [{{name: image, from: dit.image}}]
"""), source="test")
    shutil.copytree(ensure_tiny_model("pixart", MODELS), later)  # takes 32-dim embeddings, the LLM gives 256
    with pytest.raises(OmniJobFailed) as failed:
        omni(spec, settings, engines, store).generate({"prompt": "a cat"})
    error = failed.value.job.error
    assert error is not None and error.stage == "dit" and error.type == "StageError"
    assert "prompt embeddings of size 256, but model" in error.message and "takes 32" in error.message


class FlakyArtifacts(ArtifactStore):
    """A directory store whose next ``failures`` intermediate writes fail as a blip would (transient)."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(LocalBackend(root))
        self.failures = failures

    def put_intermediates(self, items: Sequence[tuple[str, bytes, str]]) -> list[ArtifactRef]:
        if self.failures > 0:
            self.failures -= 1
            raise ArtifactStoreUnavailable("local", "put", items[0][0], "disk went away")
        return super().put_intermediates(items)


def test_a_transient_error_is_retried_in_process_after_its_backoff(engines: EnginePool, store: MemoryJobStore,
                                                                   tmp_path: Path) -> None:
    settings = Settings(models_dir=MODELS, artifacts_dir=tmp_path, stage_retry_backoff_s=0.3, stage_max_retries=2)
    events: list[JobEvent] = []
    runner = Omni("text-to-text", settings=settings, engines=engines, store=store,
                  artifacts=FlakyArtifacts(tmp_path, failures=1))
    started = time.monotonic()
    result = runner.generate({"prompt": "retry me"}, {"ar": {"max_tokens": 4}}, on_event=events.append)
    waited = time.monotonic() - started
    record = result.job.stage_record("ar")
    assert record.status is StageStatus.succeeded and record.attempts == 2
    assert all(r.key.startswith(f"jobs/{result.job.id}/stages/ar/attempt-2/") for r in record.outputs.values())
    (retrying,) = [e for e in events if e.type is EventType.stage_retrying]
    assert retrying.data["attempt"] == 1 and retrying.data["reason"].startswith("ArtifactStoreUnavailable: ")
    assert 0.15 <= retrying.data["retry_in_s"] <= 0.45 and waited >= retrying.data["retry_in_s"]
    assert [e.data["attempt"] for e in events if e.type is EventType.stage_started] == [1, 2]
    assert result["text"].text
    assert_settled(store, result.job.id)

    always = Omni("text-to-text", settings=settings, engines=engines, store=store,
                  artifacts=FlakyArtifacts(tmp_path, failures=1000))
    with pytest.raises(OmniJobFailed) as failed:
        always.generate({"prompt": "never"}, {"ar": {"max_tokens": 4}})
    job = failed.value.job
    assert job.error is not None and (job.error.stage, job.error.type) == ("ar", "ArtifactStoreUnavailable")
    assert job.stage_record("ar").attempts == 3  # 1 + OMNI_STAGE_MAX_RETRIES
    assert "disk went away" in str(failed.value)
    assert_settled(store, job.id)


def test_async_omni_concurrent_and_streamed(settings: Settings, engines: EnginePool, store: MemoryJobStore) -> None:
    runner = AsyncOmni("text-to-text-and-image", settings=settings, engines=engines, store=store)
    sequential = runner.omni.generate({"prompt": "a dog"}, {"dit": {"seed": 1}})

    async def main() -> tuple[list[OmniResult], list[JobEvent | OmniResult]]:
        await runner.load()
        together = await asyncio.gather(*(runner.generate({"prompt": "a dog"}, {"dit": {"seed": 1}})
                                          for _ in range(2)))
        streamed = [item async for item in runner.stream({"prompt": "a dog"}, {"dit": {"seed": 1}})]
        return list(together), streamed

    together, streamed = asyncio.run(main())
    for result in together:
        assert {n: o.data for n, o in result.outputs.items()} == {n: o.data for n, o in sequential.outputs.items()}
    *items, last = streamed
    assert isinstance(last, OmniResult) and last["text_and_image"].data == sequential["text_and_image"].data
    events = [e for e in items if isinstance(e, JobEvent)]
    assert len(events) == len(items) and all(e.job_id == last.job.id for e in events)
    assert events[0].type == "job.queued" and events[-1].type == "job.succeeded"
    bundle = last["text_and_image"]
    assert bundle.text == sequential["text"].text and isinstance(bundle.image(), Image.Image)


def test_cli_run_writes_the_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_jobs.cli import main

    monkeypatch.setenv("OMNI_MODELS_DIR", str(MODELS))
    monkeypatch.setenv("OMNI_ARTIFACTS_DIR", str(tmp_path / "artifacts"))
    out = tmp_path / "out"
    assert main(["run", "text-to-text", "-i", "prompt=Once upon a time", "--params", '{"ar": {"max_tokens": 4}}',
                 "--out", str(out)]) == 0
    (written,) = out.iterdir()
    assert written.name.endswith("-text.json") and str(written) in capsys.readouterr().out
    assert main(["run", "text-to-text", "--params", '{"ar": {"max_tokens": 0}}']) == 2
    assert "params.ar.max_tokens" in capsys.readouterr().err
    # the flags of `omni-jobs submit`: --prompt and --param (over --params)
    out2 = tmp_path / "out2"
    assert main(["run", "text-to-text", "--prompt", "Once upon a time", "--params", '{"ar": {"max_tokens": 0}}',
                 "--param", "ar.max_tokens=4", "--out", str(out2)]) == 0
    (again,) = out2.iterdir()
    assert again.read_bytes() == written.read_bytes()  # the same job: greedy, same prompt, 4 tokens
    assert main(["run", "text-to-text", "--prompt", "hi", "--param", "max_tokens=4"]) == 2
    assert "expected STAGE.KEY=VALUE" in capsys.readouterr().err
