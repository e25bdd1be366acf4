"""The benchmark's own configuration: its pipelines are valid specs, every row has a naive twin, and
the table prints the ratios it is run for. (Its speed claims live in its output, not here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.run import (
    KV_BLOCK_BYTES,
    VLM_MODEL,
    WORKLOADS,
    Arm,
    Bench,
    DirectGroup,
    _cpu_split,
    ar_engine_args,
    data_uri,
    engine_cores_env,
    gpu_shaped_args,
    images,
    parse,
    pipelines,
    table,
)
from omni_jobs.core.settings import Settings
from omni_jobs.local import tiny
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.pipelines.catalogue import parse_pipeline


@pytest.fixture(scope="module")
def specs() -> dict[str, Any]:
    return {p["name"]: parse_pipeline(p, source=p["name"]) for p in pipelines(batch=32, ar_tokens=32, steps=20)}


def test_every_workload_has_a_valid_batched_pipeline_and_a_naive_twin(specs: dict[str, Any]) -> None:
    for w in WORKLOADS:
        batched, naive = specs[w.pipeline], specs[f"{w.pipeline}-naive"]
        assert [s.id for s in batched.stages] == [s.id for s in naive.stages]
        for b, n in zip(batched.stages, naive.stages, strict=True):
            assert (b.model, b.engine, n.queue) == (n.model, n.engine, f"{b.queue}-naive")
            assert b.batching.max_batch_size == 32
            assert (n.batching.max_batch_size, n.batching.max_in_flight) == (1, 1)


def test_every_benchmark_model_is_one_omni_jobs_tiny_builds(specs: dict[str, Any]) -> None:
    names = {s.model.removeprefix("tiny:") for spec in specs.values() for s in spec.stages
             if s.engine_args.get("kind") != "gpu-shaped"}
    assert names <= set(tiny.TINY_MODELS) | set(tiny.BENCH_MODELS)
    assert {"bench-llama-1024", "bench-pixart-128", "bench-pixart"} <= names  # larger than the test models


def test_the_gpu_shaped_rows_run_the_gpu_shaped_engine_at_256_px_on_the_dit_worker(specs: dict[str, Any]) -> None:
    rows = {w.name: w for w in WORKLOADS if w.kind == "gpu"}
    assert set(rows) == {"GPU-shaped DiT 20 ms", "GPU-shaped DiT 5 ms"}
    for w in rows.values():
        (stage,) = specs[w.pipeline].stages
        assert (stage.engine, stage.queue, w.size) == ("dit", "dit", 256)
        assert stage.engine_args == gpu_shaped_args(w.gpu_ms) == {"kind": "gpu-shaped", "ms_per_image": w.gpu_ms}
        assert (stage.defaults["height"], stage.defaults["width"]) == (256, 256)


def test_the_vlm_row_posts_a_prompt_and_an_image_to_a_chat_stage_on_the_ar_worker(specs: dict[str, Any]) -> None:
    (w,) = [w for w in WORKLOADS if w.kind == "vlm"]
    spec = specs[w.pipeline]
    assert {name: f.type for name, f in spec.inputs.items()} == {"prompt": "text", "image": "image"}
    (stage,) = spec.stages
    assert (stage.model, stage.engine, stage.queue, stage.id) == (VLM_MODEL, "ar", "ar", "ar")  # the AR row's worker
    assert {port: (b.source, b.port) for port, b in stage.inputs.items()} == {"prompt": ("input", "prompt"),
                                                                               "image": ("input", "image")}
    assert stage.defaults["chat"] is True and stage.defaults["max_tokens"] == 32
    assert VLM_MODEL.removeprefix("tiny:") in tiny.BENCH_MODELS
    # two KV blocks a request (an image's 64 tokens, the chat template, the prompt and the new tokens)
    assert stage.engine_args == ar_engine_args(32, blocks=2)
    assert ar_engine_args(32, blocks=2)["kv_cache_memory_bytes"] == (2 * 32 + 8) * KV_BLOCK_BYTES
    assert ar_engine_args(32) == {"max_num_seqs": 32, "kv_cache_memory_bytes": 40 * KV_BLOCK_BYTES}  # as before


def test_the_vlm_rows_images_are_distinct_repeatable_pngs_the_api_takes_as_they_are() -> None:
    import io

    from PIL import Image

    from omni_jobs.media.input_files import FileUpload, normalize_image, parse_file_value
    from omni_jobs.pipelines.spec import InputField

    first, again, other = images(4, rep=0), images(4, rep=0), images(4, rep=1)
    assert first == again  # both arms (two processes) make the same repetition's images
    assert len(set(first) | set(other)) == 8  # no two alike, within a repetition or across them
    with Image.open(io.BytesIO(first[0])) as image:
        assert (image.format, image.mode, image.size) == ("PNG", "RGB", (224, 224))
    source = parse_file_value(data_uri(first[0]), InputField(type="image"))
    assert isinstance(source, FileUpload) and source.data == first[0]
    png, width, height = normalize_image(source.data)  # what the API stores: the same pixels
    with Image.open(io.BytesIO(png)) as stored, Image.open(io.BytesIO(first[0])) as sent:
        assert (width, height) == (224, 224) and stored.tobytes() == sent.tobytes()


def test_table_prints_ratios_and_where_the_cpu_went() -> None:
    arm = {"jobs_per_s": 10.0, "p50_s": 1.0, "p95_s": 2.0, "stage_s": {"dit": 0.5}, "peak_rss_mib": {"dit": 800.0},
           "cpu_s": {"dit": 4.0, "api": 0.2}, "submit_span_s": 0.3}
    row = {"direct": {**arm, "jobs_per_s": 12.5}, "system": arm, "naive": {**arm, "jobs_per_s": 4.0},
           "system_over_direct": 0.8, "system_over_naive": 2.5, "cpu_direct_over_system": 0.9,
           "busy_cores_system_over_direct": 0.89}
    out = table({"rows": {"text-to-image": row},
                 "hops": {"api_to_worker_p50_ms": 4.2, "worker_to_next_stage_p50_ms": 5.0,
                          "stage_to_results_done_p50_ms": 4.4, "n": 15}})
    system_line = next(line for line in out.splitlines() if line.lstrip().startswith("system"))
    assert system_line.split()[-2:] == ["0.80", "2.50"]
    assert "dit=4.00 api=0.20 | submit span 0.30 s" in out
    assert "API->worker 4.2 ms" in out
    assert "sys/direct 0.80 = CPU 0.90 x busy cores 0.89" in out


def test_system_over_direct_splits_into_the_cpu_used_and_the_cores_kept_busy() -> None:
    # 64 jobs: direct in 10 s on 18.0 s of CPU (+0.5 s of the idle system's), system in 11 s on 20.9 s
    direct = Arm(jobs_per_s=[6.4], cpu_s={"direct": [18.0], "dit": [0.5]})
    system = Arm(jobs_per_s=[64 / 11], cpu_s={"dit": [20.0], "api": [0.4], "driver": [0.5]})
    cpu, busy = _cpu_split(system, direct, 64)
    assert cpu == pytest.approx(18.5 / 20.9) and busy == pytest.approx((20.9 / 11) / (18.5 / 10))
    assert cpu * busy == pytest.approx(10 / 11)  # system/direct, as jobs/s


def test_the_gpu_benchmarks_pipelines_are_valid_dit_specs_on_the_system_queues() -> None:
    from bench.gpu_dit import SYSTEM_QUEUES, pipeline_name
    from bench.gpu_dit import pipelines as gpu_pipelines

    made = gpu_pipelines("tiny:bench-pixart-sigma", [256, 512], batch=32, steps=20, dtype="bfloat16")
    specs = [parse_pipeline(p, source=p["name"]) for p in made]
    assert [s.name for s in specs] == [pipeline_name(256), pipeline_name(512)]
    for spec, size in zip(specs, (256, 512), strict=True):
        (stage,) = spec.stages
        assert (stage.engine, stage.queue, stage.batching.max_batch_size) == ("dit", "dit", 32)
        assert stage.queue in SYSTEM_QUEUES and "ar" not in SYSTEM_QUEUES  # no vLLM on the GPU host
        assert stage.engine_args["torch_dtype"] == "bfloat16"
        assert (stage.defaults["height"], stage.defaults["width"]) == (size, size)
    assert "bench-pixart-sigma" in tiny.BENCH_MODELS


def test_the_gpu_benchmark_reads_where_jobs_waited_from_their_records() -> None:
    from bench.gpu_dit import waits
    from omni_jobs.jobs.models import Job, StageRecord

    def job(created: float, started: float, finished: float, completed: float) -> Job:
        record = StageRecord(id="dit", engine="dit", queue="dit", started_at=started, finished_at=finished)
        return Job(id=f"job_{created}", pipeline="g", input={}, stages=[record], created_at=created,
                   completed_at=completed)

    jobs = [job(0.0, 0.010, 1.0, 1.002), job(0.1, 0.130, 1.0, 1.004), job(0.2, 0.600, 1.0, 1.001)]
    assert waits(jobs) == pytest.approx({"to_start_p50": 30.0, "to_start_max": 400.0,
                                         "after_stage_p50": 2.0, "after_stage_max": 4.0})


def bare_row() -> dict[str, Any]:
    """One workload's results with every arm the same and nothing but what ``table`` needs."""
    arm = {"jobs_per_s": 10.0, "p50_s": 1.0, "p95_s": 2.0, "stage_s": {}, "peak_rss_mib": {}, "cpu_s": {}}
    return {"direct": arm, "system": arm, "naive": arm, "system_over_direct": 1.0, "system_over_naive": 1.0}


def test_rows_only_runs_the_rows_without_hops_or_caches_and_says_so_when_asked_for_both(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--rows-only", "--jobs", "256", "--only", "text-to-text"])
    assert (args.rows_only, args.jobs, args.reps, args.hops) == (True, 256, 3, False)
    assert parse([]).rows_only is False
    for other in (["--hops"], ["--previews"]):
        with pytest.raises(SystemExit):
            parse(["--rows-only", *other])
        assert "--rows-only runs the workload rows" in capsys.readouterr().err
    row = bare_row()
    out = table({"rows": {"text-to-text": row}, "hops": {}, "cache": {}})  # what a --rows-only run leaves
    assert "text-to-text" in out and "per-hop" not in out and "cache" not in out


def test_engine_cores_leave_the_system_a_core_and_reach_both_engine_libraries(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert parse(["--engine-cores", "3"]).engine_cores == 3
    assert parse([]).engine_cores is None
    for n in ("0", "4"):
        with pytest.raises(SystemExit):
            parse(["--engine-cores", n])
        assert "give the engines 1 to 3 of this machine's 4 cores" in capsys.readouterr().err
    assert engine_cores_env(1) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert engine_cores_env(3) == {"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-2"}
    row = bare_row()
    out = table({"config": {"engine_cores": 1}, "rows": {"text-to-text": row}})
    assert out.splitlines()[0].startswith("engines: 1 thread(s) each, in both arms")
    assert "engines:" not in table({"config": {}, "rows": {"text-to-text": row}})


def test_engine_workers_lay_out_both_arms_alike(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--engine-workers", "2"]).engine_workers == 2
    assert parse([]).engine_workers == 1
    with pytest.raises(SystemExit):
        parse(["--engine-workers", "0"])
    assert "--engine-workers 0: give 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--engine-workers", "2", "--engine-cores", "1"])
    assert "choose one" in capsys.readouterr().err
    row = bare_row()
    out = table({"config": {"engine_workers": 2}, "rows": {"text-to-text": row}})
    assert out.splitlines()[0].startswith("engines: 2 workers per stage queue, each on its own cores")
    assert "engines:" not in table({"config": {"engine_workers": 1}, "rows": {"text-to-text": row}})


class _Child:
    """A direct child that answers at once: ``jobs`` in ``latency`` seconds."""

    def __init__(self, jobs: int, latency: float, cpu: float, stage: float) -> None:
        self.answer_ = {"jobs_per_s": jobs / latency, "latency": latency, "cpu_s": cpu, "stage_s": {"dit": stage}}
        self.sent: list[str] = []

    def send(self, line: str) -> None:
        self.sent.append(line)

    def answer(self) -> dict[str, object]:
        return self.answer_


def test_the_direct_arms_children_count_all_their_jobs_and_cpu_and_the_slowest_stage() -> None:
    children = [_Child(32, 1.5, 1.4, 1.5), _Child(32, 1.7, 1.6, 1.7)]
    rep = DirectGroup(children).rep(3)  # type: ignore[arg-type]
    assert [c.sent for c in children] == [["3"], ["3"]]  # both started on the same repetition
    assert rep["cpu_s"] == pytest.approx(3.0)
    assert rep["stage_s"] == {"dit": 1.7}
    assert rep["jobs_per_s"] * rep["latency"] == pytest.approx(64)  # every job of both, over the arm's own time


def test_the_b_arm_twins_each_stage_worker_on_its_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_jobs.local import embedded

    monkeypatch.setattr(embedded, "host_cpus", lambda: (0, 1))
    bench = Bench(parse(["--engine-workers", "2", "--ab", "OMNI_LOG_FORMAT=text"]))
    bench.system = EmbeddedSystem(settings=Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path),
                                  home=tmp_path, engine_workers=2)
    assert bench.b_nodes() == [("ar-b", "ar-b", {"OMNI_ENGINE_CPUS": "0"}), ("ar-b", "ar-b-2", {"OMNI_ENGINE_CPUS": "1"}),
                               ("dit-b", "dit-b", {"OMNI_ENGINE_CPUS": "0"}), ("dit-b", "dit-b-2", {"OMNI_ENGINE_CPUS": "1"})]
    bench.system = EmbeddedSystem(settings=Settings(redis_url="redis://unused:1/0", artifacts_dir=tmp_path),
                                  home=tmp_path)
    assert bench.b_nodes() == [("ar-b", "ar-b", {}), ("dit-b", "dit-b", {})]  # as before: one twin each
