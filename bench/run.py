"""Throughput benchmark: the job system against direct engine calls and a naive Celery worker.

``python -m bench`` (``--quick`` for a ~2-minute run) builds the benchmark models (omni_jobs.local.tiny),
starts one EmbeddedSystem (real API, Redis, Celery workers) and, for each workload, in one run:

* direct: the limit. ``LLM.generate`` on all prompts at once (for the image+text row, every prompt with
  its image, as the AR engine hands them to vLLM: the chat template, the image's placeholders); the
  diffusers pipeline on batches of the system's batch size. In a child process, with the same engine
  arguments.
* system: N jobs POSTed through the API to batched stage workers (threads pool, one engine,
  omni_jobs.engines.batching).
* naive: the same jobs on a solo-pool worker, one job per task, batch size 1 (what a user would
  write by hand): the same pipeline on the ``*-naive`` queues.

It prints a table (jobs/s, p50/p95 job latency, per-stage time, peak RSS per worker, ratios
system/direct and system/naive), the per-hop queue overhead (API -> worker -> next stage ->
results), and the cache effects (the stage-output cache on a repeated request; the diffusers
first-block cache on vs off), and writes everything as JSON under var/bench/results/.
``--previews [N]`` instead measures only what DiT previews cost: the same jobs through the system
with ``preview_every`` 0 and N (default 5), the arms taking turns, and prints their ratio.
One workload at a time (the machine has 2 cores); within a row the arms take turns, one repetition
each, and the ratios are medians of the per-repetition ratios (paired: they share the machine's drift).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import redis
import yaml

from bench.lean_http import JobPoster
from bench.procfs import cpu_s, memory_mib, wakeups
from bench.redis_calls import RedisCalls
from bench.redis_calls import snapshot as redis_snapshot
from omni_jobs.core import keys
from omni_jobs.core.settings import Settings
from omni_jobs.engines.allocator import engine_process_env, loaded_tcmalloc, malloc_choice, tune_engine_malloc
from omni_jobs.engines.library_env import apply_engine_library_defaults
from omni_jobs.jobs.models import Job, JobStatus
from omni_jobs.jobs.redis_store import RedisJobStore
from omni_jobs.jobs.steps import WORKER_QUEUES
from omni_jobs.local.devservices import exit_on_sigterm
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.local.tiny import resolve_model

ROOT = Path("var/bench")
AR_MODEL, DIT_SMALL, DIT_LARGE = "tiny:bench-llama-1024", "tiny:bench-pixart-128", "tiny:bench-pixart"
VLM_MODEL = "tiny:bench-qwen2.5-vl"  # the Llama's text model in Qwen2.5-VL's layout, with a vision tower
IMAGE_SIDE = 224  # a VLM job's image: 64 of the model's tokens (one per 28x28 pixels), its processor's most
DIT_TEST = "tiny:pixart"  # the test suite's DiT: per-job overhead, not compute, sets its pace
WORDS = ["harbor", "forest", "glacier", "market", "lantern", "orchard", "canyon", "meadow", "bridge", "castle"]


@dataclass(frozen=True)
class Workload:
    """One row of the table: a pipeline, its naive twin, and how to run the same work directly."""

    name: str
    pipeline: str
    kind: str  # "ar" | "dit" | "multi" | "vlm" (the AR worker, a prompt and an image a job) | "gpu" (GPU-shaped DiT)
    dit_model: str = DIT_SMALL
    size: int = 32
    gpu_ms: float = 0.0
    """For a "gpu" row: the GPU-shaped engine's milliseconds an image (gpu_shaped_args)."""


@dataclass
class Arm:
    jobs_per_s: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    stage_s: dict[str, list[float]] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    submit_span_s: list[float] = field(default_factory=list)
    """First to last job created: how long the clients took to hand the system all the work."""
    cpu_s: dict[str, list[float]] = field(default_factory=dict)
    """CPU seconds (user + system) per process and repetition: where the machine's time went."""
    batch_mean: dict[str, list[float]] = field(default_factory=dict)
    """Mean requests per engine call (admissions for AR) per worker and repetition, from its metrics."""
    engine_run_s: dict[str, list[float]] = field(default_factory=dict)
    """Seconds the worker's batches ran per repetition (its batcher's batches, from its metrics)."""
    batch_wait_s: dict[str, list[float]] = field(default_factory=dict)
    """Mean time a batch's first request waited for it to start, per worker and repetition."""
    redis_calls: RedisCalls = field(default_factory=RedisCalls)
    """The commands Redis ran during the arm's repetitions (the driver's polls included)."""
    jobs_run: int = 0
    wakeups: dict[str, int] = field(default_factory=dict)
    """Wake-ups (voluntary context switches of all threads) per process over the arm's repetitions."""

    def add_wakeups(self, before: dict[str, int], after: dict[str, int]) -> None:
        """Add each process's wake-ups between two readings (Bench.wakeups)."""
        for proc, woken in after.items():
            self.wakeups[proc] = self.wakeups.get(proc, 0) + woken - before.get(proc, 0)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "jobs_per_s": statistics.median(self.jobs_per_s) if self.jobs_per_s else None,
            "jobs_per_s_runs": [round(x, 3) for x in self.jobs_per_s],
            "p50_s": _pct(lat, 50), "p95_s": _pct(lat, 95),
            "stage_s": {k: statistics.median(v) for k, v in self.stage_s.items()},
            "peak_rss_mib": self.rss_mib,
            "cpu_s": {k: statistics.median(v) for k, v in self.cpu_s.items()},
            "submit_span_s": statistics.median(self.submit_span_s) if self.submit_span_s else None,
            "batch_mean": {k: [round(x, 2) for x in v] for k, v in self.batch_mean.items()},
            "engine_run_s": {k: [round(x, 3) for x in v] for k, v in self.engine_run_s.items()},
            "batch_wait_s": {k: [round(x, 4) for x in v] for k, v in self.batch_wait_s.items()},
        }


def _pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return sorted(values)[k]


def prompts(n: int, rep: int = 0) -> list[str]:
    """Distinct prompts of ~30 tokens (no two repeat, so the stage-output cache never hits by accident)."""
    return [f"job {rep}-{i}: a detailed story about the {WORDS[i % 10]} and the {WORDS[(i * 7 + rep) % 10]} "
            f"at dawn, number {i * 31 + rep}" for i in range(n)]


def images(n: int, rep: int = 0, side: int = IMAGE_SIDE) -> list[bytes]:
    """Distinct RGB PNGs, ``side`` x ``side`` (no two repeat, so neither vLLM's multimodal cache nor the
    stage-output cache hits by accident): a smooth pattern of each one's own with a little noise,
    ~80 KB each at 224 px, about as large as a photo's PNG."""
    import numpy as np
    from PIL import Image

    out = []
    y, x = np.mgrid[0:side, 0:side] / side
    for i in range(n):
        rng = np.random.default_rng([rep, i])
        freq, phase = rng.uniform(0.5, 4.0, (3, 2)), rng.uniform(0, 2 * np.pi, 3)
        pixels = np.stack([127.5 + 100 * np.sin(2 * np.pi * (fx * x + fy * y) + ph)
                           for (fx, fy), ph in zip(freq, phase, strict=True)], axis=-1)
        pixels += rng.normal(0, 2, pixels.shape)
        buffer = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def data_uri(png: bytes) -> str:
    """An image job input as a client sends it in JSON."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


KV_BLOCK_BYTES = 8 * 2**20
"""A KV-cache block of the benchmark's AR model: 128 tokens x 64 KiB (vLLM: 256 MiB hold 4,096 tokens)."""


def generate_images(dit: Any, texts: list[str], size: int, steps: int, batch: int) -> None:
    """The DiT work of ``len(texts)`` jobs by direct engine calls: batches of ``batch``, image i seeded i."""
    from omni_jobs.engines.dit import DiTRequest

    for i in range(0, len(texts), batch):
        dit.generate([DiTRequest(f"d{i + j}", prompt=t, height=size, width=size, num_inference_steps=steps,
                                 seed=i + j) for j, t in enumerate(texts[i:i + batch])])


def ar_engine_args(batch: int, blocks: int = 1) -> dict[str, Any]:
    """The AR engine of both arms: a batch of running requests, and a KV cache that holds it (every
    request here fits ``blocks`` blocks: a text job one, an image+text job two (~155 prompt tokens + its
    new ones); vLLM keeps one block back, and 8 more leave room for a longer prompt; ``max_num_seqs``
    still caps the batch). At the default 256 MiB it held 31:
    64 jobs ran as 31 + 31 + 2 in both arms, the last 2 alone for a wave's steps, and the multi-stage
    row's DiT batches followed the waves (31, 31, 2) where its direct arm ran 32 + 32. (The VLM's text
    model has the Llama's KV size a token, 64 KiB.)"""
    seqs = max(batch, 16)
    return {"max_num_seqs": seqs, "kv_cache_memory_bytes": (seqs * blocks + 8) * KV_BLOCK_BYTES}


GPU_SHAPED_MS = (20.0, 5.0)
"""The GPU-shaped rows (issue 61): the H200's 20 ms an image at 256 px, and a model four times as fast."""
GPU_SIZE = 256


def gpu_shaped_args(ms: float) -> dict[str, Any]:
    """The engine_args of the GPU-shaped engine in both arms (omni_jobs.engines.gpu_shaped: the H200's profile
    otherwise: batches of 32, 6% of the time holding the interpreter's lock)."""
    return {"kind": "gpu-shaped", "ms_per_image": ms}


def pipelines(batch: int, ar_tokens: int, steps: int) -> list[dict[str, Any]]:
    """The benchmark pipelines: each batched one and its naive twin (solo queue, batch 1)."""
    ar_args = ar_engine_args(batch)
    naive = {"max_batch_size": 1, "wait_ms": 0, "max_in_flight": 1}
    batched = {"max_batch_size": batch, "wait_ms": 20}

    def ar_stage(queue: str, batching: dict[str, Any], tokens: int) -> dict[str, Any]:
        return {"id": "ar", "engine": "ar", "model": AR_MODEL, "queue": queue, "inputs": {"prompt": "input.prompt"},
                "engine_args": ar_args, "batching": batching,
                "defaults": {"max_tokens": tokens, "temperature": 0.0, "prompt_template": "{prompt}"}}

    def vlm_stage(queue: str, batching: dict[str, Any]) -> dict[str, Any]:  # the image-to-text pipeline's stage
        return {"id": "ar", "engine": "ar", "model": VLM_MODEL, "queue": queue,
                "inputs": {"prompt": "input.prompt", "image": "input.image"},
                "engine_args": ar_engine_args(batch, blocks=2), "batching": batching,
                "defaults": {"max_tokens": ar_tokens, "temperature": 0.0, "chat": True}}

    def dit_stage(queue: str, batching: dict[str, Any], model: str, size: int, source: str,
                  engine_args: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": "dit", "engine": "dit", "model": model, "queue": queue, "inputs": {"prompt": source},
                "engine_args": engine_args or {"pipeline_class": "PixArtSigmaPipeline"}, "batching": batching,
                "defaults": {"height": size, "width": size, "num_inference_steps": steps, "seed": 0}, **extra}

    out: list[dict[str, Any]] = []
    for suffix, queue_sfx, policy in (("", "", batched), ("-naive", "-naive", naive), ("-b", "-b", batched)):
        inputs = {"prompt": {"type": "text", "max_length": 2000}}
        out.append({"name": f"b-text{suffix}", "inputs": inputs, "stages": [ar_stage("ar" + queue_sfx, policy, ar_tokens)],
                    "outputs": [{"name": "text", "from": "ar.text"}]})
        for label, model, size in (("small", DIT_SMALL, 32), ("large", DIT_LARGE, 64), ("test", DIT_TEST, 32)):
            out.append({"name": f"b-image-{label}{suffix}", "inputs": inputs,
                        "stages": [dit_stage("dit" + queue_sfx, policy, model, size, "input.prompt")],
                        "outputs": [{"name": "image", "from": "dit.image"}]})
        for ms in GPU_SHAPED_MS:  # on the DiT worker, as the real DiT's rows
            out.append({"name": f"b-gpu-{ms:g}{suffix}", "inputs": inputs,
                        "stages": [dit_stage("dit" + queue_sfx, policy, "gpu-shaped", GPU_SIZE, "input.prompt",
                                             gpu_shaped_args(ms))],
                        "outputs": [{"name": "image", "from": "dit.image"}]})
        out.append({"name": f"b-vlm{suffix}", "inputs": {**inputs, "image": {"type": "image"}},
                    "stages": [vlm_stage("ar" + queue_sfx, policy)], "outputs": [{"name": "text", "from": "ar.text"}]})
        out.append({"name": f"b-multi{suffix}", "inputs": inputs,
                    "stages": [ar_stage("ar" + queue_sfx, policy, 16),
                               dit_stage("dit" + queue_sfx, policy, DIT_SMALL, 32, "ar.text")],
                    "outputs": [{"name": "image", "from": "dit.image"}, {"name": "text", "from": "ar.text"}]})
    out.append({"name": "b-image-cached", "inputs": {"prompt": {"type": "text"}},
                "stages": [dit_stage("dit", batched, DIT_LARGE, 64, "input.prompt", cache={"enabled": True})],
                "outputs": [{"name": "image", "from": "dit.image"}]})
    return out


WORKLOADS = [
    Workload("text-to-text (AR)", "b-text", "ar"),
    Workload("image+text (VLM)", "b-vlm", "vlm"),
    Workload("text-to-image DiT 32px small", "b-image-small", "dit", DIT_SMALL, 32),
    Workload("text-to-image DiT 64px large", "b-image-large", "dit", DIT_LARGE, 64),
    Workload("multi-stage AR->DiT", "b-multi", "multi", DIT_SMALL, 32),
    Workload("text-to-image DiT 32px test model", "b-image-test", "dit", DIT_TEST, 32),
    *(Workload(f"GPU-shaped DiT {ms:g} ms", f"b-gpu-{ms:g}", "gpu", size=GPU_SIZE, gpu_ms=ms) for ms in GPU_SHAPED_MS),
]
"""The test model's row is no target: the test suite's DiT does ~14 ms of engine work per image, so it shows
the floor that the system's own per-job cost (API, Redis, Celery, results: a few ms) sets. The GPU-shaped rows
(issue 61) run the benchmark's stand-in for a DiT on a GPU (omni_jobs.engines.gpu_shaped) at 256 px: the
engine needs the interpreter's lock for 6% of its time and no core for the rest, so what they measure is the
system's own cost beside a GPU's engine, in today's layout (the engine in the worker's process)."""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = args.jobs
        self.reps: int = args.reps
        self.models_dir = (ROOT / "models").resolve()
        self.system: EmbeddedSystem | None = None
        self.poster: JobPoster | None = None
        self.store: RedisJobStore | None = None
        self.results: dict[str, Any] = {"config": vars(args), "rows": {}, "hops": {}, "cache": {}, "previews": {}}

    # --- the system under test ---
    def start(self) -> None:
        # as `omni-jobs up`, plus the naive twins where their arm runs: idle, the two took ~0.35 ms of CPU a
        # job of the DiT row from the engines' cores (python -m bench.worker_threads)
        naive = {} if self.args.no_naive else {"ar-naive": "solo", "dit-naive": "solo"}
        self.start_system([AR_MODEL, VLM_MODEL, DIT_SMALL, DIT_LARGE, DIT_TEST],
                          pipelines(self.args.batch, self.args.ar_tokens, self.args.steps), {**WORKER_QUEUES, **naive})
        if self.args.ab is not None:
            assert self.system
            self.start_b_workers(self.system.extra_env)

    def start_system(self, models: list[str], pipes: list[dict[str, Any]], queues: dict[str, str]) -> None:
        """Build ``models``, write ``pipes`` where the API and workers find them, and start one
        EmbeddedSystem from an empty Redis with one worker per queue of ``queues`` (queue -> pool)."""
        for model in models:
            resolve_model(model, self.models_dir)  # tiny: models are built here, once
        pipes_dir = ROOT / "pipelines"
        shutil.rmtree(pipes_dir, ignore_errors=True)
        pipes_dir.mkdir(parents=True)
        for p in pipes:
            (pipes_dir / f"{p['name']}.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
        home = ROOT / "system"
        shutil.rmtree(home / "redis", ignore_errors=True)  # every run starts from an empty Redis
        settings = Settings(models_dir=self.models_dir, artifacts_dir=(home / "artifacts").resolve(),
                            redis_url="redis://unused")
        # each worker holds its share of the 2 batches in flight, at least one whole batch
        in_flight = max(self.args.batch, self.args.batch * 2 // self.args.engine_workers)
        env = {"OMNI_PIPELINES_PATH": json.dumps([str(pipes_dir.resolve())]),
               "OMNI_STAGE_MAX_IN_FLIGHT": str(in_flight), "OMNI_BATCH_MAX_SIZE": str(self.args.batch),
               "OMNI_LOG_FORMAT": "text", "OMNI_AUTH_ENABLED": "false",
               "OMNI_MAX_QUEUED_PER_QUEUE": "100000"}
        self.system = EmbeddedSystem(settings=settings, home=home.resolve(), extra_env=env, worker_queues=queues,
                                     with_flower=False, redis_durability=self.args.redis_durability,
                                     engine_workers=self.args.engine_workers)
        os.environ.setdefault("OMNI_AUTH_ENABLED", "false")
        self.system.start(say=lambda m: print(f"  [system] {m}", flush=True))
        assert self.system.redis_url
        headers = {"Authorization": f"Bearer {self.system.api_key}"} if self.system.api_key else {}
        self.poster = JobPoster(self.system.api_url, headers)  # a lean client: see bench.lean_http
        self.store = RedisJobStore(redis.Redis.from_url(self.system.redis_url), ttl_s=3600)

    def start_b_workers(self, env: dict[str, str]) -> None:
        """The B arm (--ab KEY=VALUE ...): threads workers on the ar-b/dit-b queues, as the system's own
        but with these settings, so that one run compares both side by side."""
        assert self.system
        overrides = dict(kv.split("=", 1) for kv in self.args.ab)
        tree = self.args.ab_tree.resolve() if self.args.ab_tree is not None else None
        if tree is not None:  # another checkout's code: its workers start there and import from there
            overrides["PYTHONPATH"] = str(tree)
        for queue, node, slice_env in self.b_nodes():
            self.system.metrics_ports[node] = free_port()
            argv = [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", "threads",
                    "-c", env["OMNI_STAGE_MAX_IN_FLIGHT"], "-n", f"{node}@%h", "--loglevel", "INFO"]
            self.system._spawn(f"worker-{node}", argv, 0, lambda: True,
                               env=self.system.worker_env({"OMNI_METRICS_PORT": str(self.system.metrics_ports[node]),
                                                           **slice_env, **overrides}), cwd=tree)
        twins = Counter(queue for queue, _, _ in self.b_nodes())
        self.system.wait_for_workers(set(twins), expected=twins)

    def b_nodes(self) -> list[tuple[str, str, dict[str, str]]]:
        """Queue, node name and environment of each B worker: the system's stage workers' twins (``ar-b``, and
        with --engine-workers ``ar-b-2``..., each on the CPUs of its twin)."""
        assert self.system
        return [(f"{q}-b", f"{q}-b" + node.removeprefix(q), slice_env)
                for q in ("ar", "dit") for node, slice_env in self.system.worker_nodes(q)]

    def stage_nodes(self, queues: tuple[str, ...] | list[str]) -> list[str]:
        """The worker nodes of these stage queues: ``ar``, or ``ar``, ``ar-2``... with --engine-workers."""
        assert self.system
        return [node for q in queues for node, _ in self.system.worker_nodes(q)]

    def stop(self) -> None:
        if self.system is not None:
            self.system.stop()

    def worker_rss(self, queue: str) -> float:
        """Peak RSS (VmHWM) of the worker process of ``queue``, MiB."""
        assert self.system
        for proc in self.system.processes:
            if proc.name == f"worker-{queue}" and proc.pid:
                return memory_mib(proc.pid, "VmHWM")
        return float("nan")

    def batch_totals(self, node: str) -> dict[str, float]:
        """What the worker ``node`` counted of its batches so far: requests and engine calls
        (omni_jobs_engine_batch_size), batcher batches, their run and first-request wait seconds
        (omni_jobs_engine_batch_run_seconds, _wait_seconds); summed over its engines."""
        assert self.system
        totals = dict.fromkeys(_BATCH_SERIES.values(), 0.0)
        port = self.system.metrics_ports.get(node)
        if port is None:
            return totals
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return totals
        for line in text.splitlines():
            series = _BATCH_SERIES.get(line.split("{", 1)[0])
            if series is not None:
                totals[series] += float(line.rsplit(" ", 1)[1])
        return totals

    def processes(self) -> dict[str, int]:
        """Name -> pid of each process of the system (Redis, API, workers: ``ar``, ``dit``...) and this driver."""
        assert self.system
        out = {"driver": os.getpid()}
        out.update({p.name.removeprefix("worker-"): p.pid for p in self.system.processes if p.pid})
        return out

    def cpu_times(self) -> dict[str, float]:
        """CPU seconds used so far by each process of the system and this driver."""
        return {name: cpu_s(pid) for name, pid in self.processes().items()}

    def wakeups(self) -> dict[str, int]:
        """Wake-ups so far of each process of the system and this driver (bench.procfs.wakeups)."""
        return {name: wakeups(pid) for name, pid in self.processes().items()}

    def redis_calls(self) -> RedisCalls:
        """Redis's command counts now, its clients named by process (bench.redis_calls)."""
        assert self.store
        return redis_snapshot(self.store.redis, {pid: name for name, pid in self.processes().items()})

    def run_jobs(self, pipeline: str, texts: list[str], params: dict[str, Any] | None = None,
                 image_uris: list[str] | None = None) -> list[Job]:
        """POST every job through the API (job i: ``texts[i]``, and ``image_uris[i]`` as its image where
        given), then wait for all; returns the final jobs (from Redis)."""
        assert self.poster and self.store
        poster = self.poster
        inputs = [{"prompt": t} if image_uris is None else {"prompt": t, "image": image_uris[i]}
                  for i, t in enumerate(texts)]

        def post(input_: dict[str, str]) -> str:
            code, body = poster.post("/v1/jobs", {"pipeline": pipeline, "input": input_, "params": params or {}})
            if code != 202:
                raise RuntimeError(f"submit {pipeline}: {code} {body.decode(errors='replace')}")
            return str(json.loads(body)["id"])

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(8, len(texts))) as pool:  # clients submit concurrently
            ids = list(pool.map(post, inputs))
        deadline = time.monotonic() + 900
        pending = list(ids)
        finished: dict[str, Job] = {}
        while pending and time.monotonic() < deadline:  # cheap polling: the driver shares the 2 cores
            time.sleep(0.5)  # the jobs carry their own times: polling faster only takes CPU from the engines
            with self.store.redis.pipeline(transaction=False) as pipe:
                for job_id in pending:
                    pipe.hget(keys.job(job_id), "status")
                statuses = pipe.execute()
            final = [i for i, s in zip(pending, statuses, strict=True) if s is not None and JobStatus(s.decode()).is_final]
            for job_id, job in zip(final, self.store.get_many(final), strict=True):
                if job is not None:
                    finished[job_id] = job
            pending = [i for i in pending if i not in finished]
        missing = [i for i in ids if i not in finished]
        finished.update({i: j for i, j in zip(missing, self.store.get_many(missing), strict=True) if j is not None})
        jobs = [finished[i] for i in ids if i in finished]
        bad = [(j.id, j.status.value, j.error) for j in jobs if j.status.value != "succeeded"]
        if bad:
            raise RuntimeError(f"{pipeline}: {len(bad)} jobs did not succeed, e.g. {bad[0]}")
        return jobs

    def system_rep(self, pipeline: str, rep: int, arm: Arm, params: dict[str, Any] | None = None,
                   salt: int = 0, with_images: bool = False) -> list[Job]:
        """One repetition of N jobs through the API (``with_images``: each with its image); adds its
        figures to ``arm``."""
        # every arm of a row gets the same prompts (and images) in a repetition (direct_rep too): the same
        # work. Each arm runs in its own process, so no arm finds another's prompts in its prefix cache.
        texts = prompts(self.n, rep + salt)
        image_uris = [data_uri(png) for png in images(self.n, rep + salt)] if with_images else None
        nodes = [] if pipeline.endswith("-naive") else ([node for _, node, _ in self.b_nodes()] if pipeline.endswith("-b")
                                                        else self.stage_nodes(("ar", "dit")))
        batches_before = {n: self.batch_totals(n) for n in nodes}
        # the CPU counted is the jobs' alone: reading the workers' /metrics (batch_totals) cost the driver
        # ~25 ms per read and the worker its render, outside the repetition's window
        calls_before, wakeups_before = self.redis_calls(), self.wakeups()
        cpu_before = self.cpu_times()
        jobs = self.run_jobs(pipeline, texts, params, image_uris)
        cpu_after = self.cpu_times()
        arm.redis_calls += self.redis_calls() - calls_before
        arm.add_wakeups(wakeups_before, self.wakeups())
        arm.jobs_run += len(jobs)
        for n in nodes:
            after, before = self.batch_totals(n), batches_before[n]
            d = {k: after[k] - before[k] for k in after}
            if d["calls"] > 0:
                arm.batch_mean.setdefault(n, []).append(d["requests"] / d["calls"])
            if d["batches"] > 0:
                arm.engine_run_s.setdefault(n, []).append(d["run_s"])
                arm.batch_wait_s.setdefault(n, []).append(d["wait_s"] / d["batches"])
        for name, cpu in cpu_after.items():
            arm.cpu_s.setdefault(name, []).append(cpu - cpu_before.get(name, 0.0))
        start = min(j.created_at for j in jobs)
        end = max(j.completed_at or 0 for j in jobs)
        arm.jobs_per_s.append(len(jobs) / (end - start))
        arm.submit_span_s.append(max(j.created_at for j in jobs) - start)
        arm.latencies += [(j.completed_at or 0) - j.created_at for j in jobs]
        for j in jobs:
            for rec in j.stages:
                if rec.started_at and rec.finished_at:
                    arm.stage_s.setdefault(rec.id, []).append(rec.finished_at - rec.started_at)
        return jobs

    def previews(self) -> None:
        """What DiT previews cost: N jobs with preview_every 0, then N with preview_every K, per
        repetition (paired, so that both share the machine's drift), on the small DiT at 32x32
        (the cheapest steps, so the largest relative cost) and the large one at 64x64."""
        every = self.args.previews
        chosen = [w for w in WORKLOADS if w.kind == "dit" and w.dit_model in (DIT_SMALL, DIT_LARGE)
                  and (self.args.only is None or any(o in w.name for o in self.args.only))]
        for w in chosen:
            print(f"\n== previews, {w.name}: {self.n} jobs x {self.reps} reps, preview_every 0 vs {every}", flush=True)
            self.run_jobs(w.pipeline, [f"warm up {t}" for t in prompts(min(self.args.batch, self.n), 998)],
                          {"dit": {"preview_every": every}})
            off, on = Arm(), Arm()
            shown: list[int] = []
            for rep in range(self.reps):
                if rep % 2:  # alternate which arm goes first: neither always runs on a warmer machine
                    jobs = self.system_rep(w.pipeline, rep, on, {"dit": {"preview_every": every}}, salt=600)
                    self.system_rep(w.pipeline, rep, off, salt=300)
                else:
                    self.system_rep(w.pipeline, rep, off, salt=300)
                    jobs = self.system_rep(w.pipeline, rep, on, {"dit": {"preview_every": every}}, salt=600)
                assert self.store is not None
                sizes = [len(str(e.data["data"])) for e in self.store.events(jobs[0].id, count=10_000)
                         if e.type == "output.preview"]  # the preview's base64 text
                shown.append(len(sizes))
                preview_bytes = max(sizes, default=0)
                print(f"  rep {rep + 1}: off {off.jobs_per_s[-1]:.2f}, on {on.jobs_per_s[-1]:.2f} jobs/s "
                      f"({on.jobs_per_s[-1] / off.jobs_per_s[-1]:.3f})", flush=True)
            ratios = _ratios(on.jobs_per_s, off.jobs_per_s)
            worker_cpu = _ratios(off.cpu_s.get("dit", []), on.cpu_s.get("dit", []))  # CPU: less noisy than time
            engine = self.engine_preview_cost(w, every)
            self.results["previews"][w.name] = {
                "preview_every": every, "steps": self.args.steps, "previews_per_job": max(shown),
                "preview_base64_bytes": preview_bytes, "engine": engine,
                "off": off.summary(), "on": on.summary(), "on_over_off": statistics.median(ratios),
                "worker_cpu_off_over_on": statistics.median(worker_cpu) if worker_cpu else None,
                "on_over_off_runs": [round(r, 3) for r in ratios],
            }

    def engine_preview_cost(self, w: Workload, every: int) -> dict[str, Any]:
        """The same on one engine in this process, no Redis: batches without previews, and with
        previews projected and JPEG-encoded inline on the engine's thread (worse than the system,
        which does that on another thread): the compute a preview costs, without the system's noise."""
        from omni_jobs.engines.dit import DiTRequest

        engine = self._dit(w.dit_model)
        texts = prompts(self.args.batch, 700)

        preview_cpu: list[float] = []

        def batch(with_previews: bool) -> tuple[float, float]:
            made: list[int] = []

            def encode(preview: Any) -> None:
                c0 = time.thread_time()
                made.append(len(preview.event_data("dit")["data"]))
                preview_cpu.append(time.thread_time() - c0)

            requests = [DiTRequest(f"p{i}", prompt=t, height=w.size, width=w.size, num_inference_steps=self.args.steps,
                                   seed=i, preview_every=every if with_previews else 0, on_preview=encode)
                        for i, t in enumerate(texts)]
            t0, c0 = time.perf_counter(), time.process_time()
            engine.generate(requests)
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert bool(made) == with_previews
            return took, cpu

        batch(True)  # warm up (and fit the projection)
        preview_cpu.clear()
        off: list[tuple[float, float]] = []
        on: list[tuple[float, float]] = []
        for rep in range(max(self.reps, 5)):
            for with_previews in ((False, True) if rep % 2 == 0 else (True, False)):
                (on if with_previews else off).append(batch(with_previews))
        ratios = [a[0] / b[0] for a, b in zip(off, on, strict=True)]  # throughput on / off
        cpu_ratios = [a[1] / b[1] for a, b in zip(off, on, strict=True)]
        per_job_cpu = statistics.median(c for _, c in off) / len(texts)
        per_preview = statistics.median(preview_cpu)
        share = per_preview * (len(preview_cpu) / len(on) / len(texts)) / per_job_cpu
        print(f"  engine alone (batch {len(texts)}, previews encoded inline): off {statistics.median(w for w, _ in off):.2f} s, "
              f"on {statistics.median(w for w, _ in on):.2f} s per batch; on/off throughput {statistics.median(ratios):.3f}, "
              f"CPU off/on {statistics.median(cpu_ratios):.3f}; one preview {1000 * per_preview:.2f} ms CPU, "
              f"{share:.2%} of a job's engine CPU", flush=True)
        return {"batch": len(texts), "off_s": statistics.median(w for w, _ in off),
                "on_s": statistics.median(w for w, _ in on), "on_over_off": statistics.median(ratios),
                "on_over_off_runs": [round(r, 3) for r in ratios], "cpu_off_over_on": statistics.median(cpu_ratios),
                "preview_cpu_ms": 1000 * per_preview, "job_engine_cpu_ms": 1000 * per_job_cpu,
                "preview_share_of_engine_cpu": share}

    # --- the limit: direct engine calls, in a child process per workload ---
    def direct_process(self, w: Workload) -> DirectGroup:
        """vLLM pins the threads of the process that loads it, which would slow a diffusers pipeline
        run after it in the same process (and peak RSS would mix): each workload gets a fresh one.
        With --engine-workers N, N of them, each on the cores a system worker of that index gets, each
        doing its share of the jobs: the engines laid out as the system's."""
        assert self.system
        layout = [slice_env for _, slice_env in self.system.worker_nodes("dit")]  # the system's stage workers' CPUs
        children = []
        for part, slice_env in enumerate(layout):
            argv = [sys.executable, "-m", "bench.run", "--direct", w.name, "--jobs", str(self.n),  # reps: one per request
                    "--batch", str(self.args.batch), "--ar-tokens", str(self.args.ar_tokens),
                    "--steps", str(self.args.steps), "--direct-part", f"{part}/{len(layout)}"]
            children.append(DirectProcess(argv, ROOT / "logs" / f"direct-{part}.log", slice_env))
        return DirectGroup(children)

    def serve_direct(self, w: Workload) -> None:
        """The child's side of DirectProcess: load and warm up, then one repetition per request line."""
        as_engine_process()  # as workers/app.py does; the parent gave this child the environment
        from omni_jobs.engines.ar import AREngine

        vlm = w.kind == "vlm"
        if w.kind != "gpu":  # the GPU-shaped rows need no vLLM (whose load pins this process's threads)
            self._ar = AREngine(resolve_model(VLM_MODEL if vlm else AR_MODEL, self.models_dir),
                                engine_args=ar_engine_args(self.args.batch, blocks=2 if vlm else 1))
        dit = self._dit(w.dit_model) if w.kind in ("dit", "multi") else None
        if w.kind == "gpu":
            from omni_jobs.engines.gpu_shaped import GpuShapedDiT

            dit = GpuShapedDiT.from_args(gpu_shaped_args(w.gpu_ms))
        self._warm_up(w, dit)  # as the system's warm-up jobs do: no arm pays first-call costs
        _reply({"ready": True})
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            _reply(self.direct_rep(w, dit, int(line)))
        _reply({"rss_mib": {"driver": round(memory_mib(os.getpid(), "VmHWM"), 1)}})

    def direct_rep(self, w: Workload, dit: Any, rep: int) -> dict[str, Any]:
        """One repetition of the same work as N jobs, by direct engine calls."""
        part, parts = map(int, self.args.direct_part.split("/"))
        texts = prompts(self.n, rep)[part::parts]  # the system arm's prompts of this repetition (system_rep)
        pngs = images(self.n, rep)[part::parts] if w.kind == "vlm" else []  # and its images
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        stage: dict[str, float] = {}
        if w.kind in ("ar", "multi"):
            from vllm import SamplingParams

            tokens = self.args.ar_tokens if w.kind == "ar" else 16
            outs = self._ar._llm.generate(texts, SamplingParams(max_tokens=tokens, temperature=0.0), use_tqdm=False)
            texts = [o.outputs[0].text or "empty" for o in outs]
            stage["ar"] = time.perf_counter() - t0
        if w.kind == "vlm":
            self.generate_vlm(texts, pngs, f"d{rep}")
            stage["ar"] = time.perf_counter() - t0
        if dit is not None:
            t1 = time.perf_counter()
            generate_images(dit, texts, w.size, self.args.steps, self.args.batch)
            stage["dit"] = time.perf_counter() - t1
        elapsed = time.perf_counter() - t0
        # every job of a direct batch ends with the batch: its latency is the whole call
        return {"jobs_per_s": len(texts) / elapsed, "latency": elapsed, "stage_s": stage,
                "cpu_s": time.process_time() - cpu0}

    def generate_vlm(self, texts: list[str], pngs: list[bytes], prefix: str) -> None:
        """Image+text jobs by one direct engine call: each PNG decoded (as the system's worker decodes its
        stored input), then every prompt with its image as ONE ``LLM.generate``, built as the AR engine
        builds a stage's request (omni_jobs.engines.ar: the chat template, the image's placeholders,
        ``multi_modal_data``), so that both arms hand vLLM the same inputs."""
        from omni_jobs.artifacts import codecs
        from omni_jobs.engines.ar import ARRequest, SamplingOptions

        sampling = SamplingOptions(max_tokens=self.args.ar_tokens, temperature=0.0)
        self._ar.generate([ARRequest(f"{prefix}-{i}", t, sampling, media={"image": [codecs.decode_png(png)]}, chat=True)
                           for i, (t, png) in enumerate(zip(texts, pngs, strict=True))])

    def _warm_up(self, w: Workload, dit: Any) -> None:
        n = min(self.args.batch, self.n)  # a full batch: the first call at a batch size allocates for it
        if w.kind == "vlm":  # a repetition's call, as for text
            self.generate_vlm(prompts(self.n, 999), images(self.n, 999), "warm")
        if w.kind in ("ar", "multi"):  # a repetition's call: after 4 tokens, the first ran 1.5-2x slower than the next
            from vllm import SamplingParams

            tokens = self.args.ar_tokens if w.kind == "ar" else 16
            self._ar._llm.generate(prompts(self.n, 999), SamplingParams(max_tokens=tokens, temperature=0.0),
                                   use_tqdm=False)
        if dit is not None:
            generate_images(dit, prompts(n, 999), w.size, self.args.steps, n)

    def _dit(self, model: str, cache: dict[str, Any] | None = None) -> Any:
        from omni_jobs.engines.dit import DiTEngine

        key = f"_dit_{model}_{json.dumps(cache, sort_keys=True)}"
        if not hasattr(self, key):
            setattr(self, key, DiTEngine(resolve_model(model, self.models_dir),
                                         pipeline_class="PixArtSigmaPipeline", cache=cache))
        return getattr(self, key)

    # --- the rows ---
    def row(self, w: Workload) -> None:
        """The three arms take turns, one repetition each, so that all of them share the machine's
        drift (on a shared 2-core VM, speed moves by tens of % over minutes); the ratios are the
        medians of the per-repetition ratios."""
        print(f"\n== {w.name}: {self.n} jobs x {self.reps} reps", flush=True)
        queues = {"ar": ["ar"], "vlm": ["ar"], "dit": ["dit"], "gpu": ["dit"], "multi": ["ar", "dit"]}[w.kind]
        with_images = w.kind == "vlm"

        def warm_up(pipeline: str, n: int, rep: int) -> None:
            uris = [data_uri(png) for png in images(n, rep)] if with_images else None
            self.run_jobs(pipeline, [f"warm up {t}" for t in prompts(n, rep)], image_uris=uris)

        # warm-up: a full batch through the system, a job through the naive path: no arm pays first-call costs
        warm_up(w.pipeline, min(self.args.batch, self.n), 998)
        if not self.args.no_naive:
            warm_up(w.pipeline + "-naive", 1, 996)
        direct, system, naive, b = Arm(), Arm(), Arm(), Arm()
        if self.args.ab is not None:
            warm_up(w.pipeline + "-b", min(self.args.batch, self.n), 997)
        with self.direct_process(w) as child:
            for rep in range(self.reps):
                idle_before = self.cpu_times()
                woken_before = {**self.wakeups(), "direct": sum(wakeups(pid) for pid in child.pids)}
                d = child.rep(rep)
                direct.add_wakeups(woken_before, {**self.wakeups(), "direct": sum(wakeups(pid) for pid in child.pids)})
                direct.jobs_run += self.n
                for proc, cpu in self.cpu_times().items():  # the system's processes, idle meanwhile: both arms pay them
                    if proc != "driver":
                        direct.cpu_s.setdefault(proc, []).append(cpu - idle_before.get(proc, 0.0))
                direct.jobs_per_s.append(d["jobs_per_s"])
                direct.latencies.append(d["latency"])
                direct.cpu_s.setdefault("direct", []).append(d["cpu_s"])
                for k, v in d["stage_s"].items():
                    direct.stage_s.setdefault(k, []).append(v)
                if self.args.ab is not None and rep % 2:  # alternate which of the two goes first
                    self.system_rep(w.pipeline + "-b", rep, b, with_images=with_images)
                self.system_rep(w.pipeline, rep, system, with_images=with_images)
                if self.args.ab is not None and not rep % 2:
                    self.system_rep(w.pipeline + "-b", rep, b, with_images=with_images)
                if not self.args.no_naive:
                    self.system_rep(w.pipeline + "-naive", rep, naive, with_images=with_images)
                print(f"  rep {rep + 1}: direct {direct.jobs_per_s[-1]:.2f}, system {system.jobs_per_s[-1]:.2f}, "
                      + (f"B {b.jobs_per_s[-1]:.2f}, " if self.args.ab is not None else "")
                      + (f"naive {naive.jobs_per_s[-1]:.2f} " if naive.jobs_per_s else "") + "jobs/s", flush=True)
            direct.rss_mib = child.close()["rss_mib"]
        system.rss_mib = {node: round(self.worker_rss(node), 1) for node in self.stage_nodes(queues)}
        if naive.jobs_per_s:
            naive.rss_mib = {f"{q}-naive": round(self.worker_rss(f"{q}-naive"), 1) for q in queues}
        else:
            naive.jobs_per_s = [float("nan")] * self.reps
        print(f"  system cpu {_cpu_line(system.summary()['cpu_s'])} submit span {system.submit_span_s}", flush=True)
        if b.jobs_per_s:
            print(f"  B      cpu {_cpu_line(b.summary()['cpu_s'])}", flush=True)
        print(f"  mean batch: system {system.summary()['batch_mean']}"
              + (f", B {b.summary()['batch_mean']}" if b.jobs_per_s else ""), flush=True)
        print(f"  naive  cpu {_cpu_line(naive.summary()['cpu_s'])}", flush=True)
        for label, arm in (("direct", direct), ("system", system), ("B", b)):
            if arm.redis_calls.by_command:
                print(f"  redis, {label}: {arm.redis_calls.per_job(arm.jobs_run)}", flush=True)
            if arm.jobs_run:
                ranked = sorted(((v / arm.jobs_run, k) for k, v in arm.wakeups.items()), reverse=True)
                print(f"  wake-ups a job, {label}: " + ", ".join(f"{k} {v:.1f}" for v, k in ranked if v >= 0.05),
                      flush=True)
        for line in _engine_time_lines(system, direct, self.n):
            print(f"  {line}", flush=True)
        over_direct, over_naive = _ratios(system.jobs_per_s, direct.jobs_per_s), _ratios(system.jobs_per_s, naive.jobs_per_s)
        cpu_ratio, busy_ratio = _cpu_split(system, direct, self.n)
        self.results["rows"][w.name] = {
            "system": system.summary(), "direct": direct.summary(), "naive": naive.summary(),
            "system_over_direct": statistics.median(over_direct), "system_over_naive": statistics.median(over_naive),
            "system_over_direct_runs": [round(r, 3) for r in over_direct],
            "cpu_direct_over_system": cpu_ratio, "busy_cores_system_over_direct": busy_ratio,
        }
        if b.jobs_per_s:
            ab = _ratios(system.jobs_per_s, b.jobs_per_s)
            b_direct = _ratios(b.jobs_per_s, direct.jobs_per_s)
            self.results["rows"][w.name].update({
                "b": b.summary(), "b_env": self.args.ab, "b_over_direct": statistics.median(b_direct),
                "system_over_b": statistics.median(ab), "system_over_b_runs": [round(r, 3) for r in ab]})
            print(f"  A/B: system/B {statistics.median(ab):.3f} (runs {[round(r, 3) for r in ab]}), B/direct "
                  f"{statistics.median(b_direct):.3f}, system/direct {statistics.median(over_direct):.3f}; "
                  f"p50 system {_f(system.summary()['p50_s'])} s, B {_f(b.summary()['p50_s'])} s", flush=True)

    def hops(self) -> None:
        """Queue overhead per hop on an idle system: jobs one at a time through the multi-stage pipeline
        (with --ab, the system's and the B arm's jobs alternate, so both see the same machine)."""
        arms = {"system": "b-multi", **({"b": "b-multi-b"} if self.args.ab is not None else {})}
        hops: dict[str, list[tuple[float, float, float, float]]] = {arm: [] for arm in arms}
        for i in range(self.args.hop_jobs):
            for arm, pipeline in (arms.items() if i % 2 else reversed(arms.items())):
                (job,) = self.run_jobs(pipeline, [f"hop {i}"])
                ar, dit = job.stage_record("ar"), job.stage_record("dit")
                assert ar.started_at and ar.finished_at and dit.started_at and dit.finished_at and job.completed_at
                # the last hop from the DiT's engine end: results inline end the job in the stage's own
                # write (its finished_at), after its outputs are encoded, stored and written
                engine_end = dit.started_at + dit.metrics.get("engine_s", 0.0)
                hops[arm].append((ar.started_at - job.created_at, dit.started_at - ar.finished_at,
                                  job.completed_at - dit.finished_at, job.completed_at - engine_end))
        for arm, seen in hops.items():
            self.results["hops" if arm == "system" else "hops_b"] = {
                "api_to_worker_p50_ms": 1000 * statistics.median(h[0] for h in seen),
                "worker_to_next_stage_p50_ms": 1000 * statistics.median(h[1] for h in seen),
                "stage_to_results_done_p50_ms": 1000 * statistics.median(h[2] for h in seen),
                "engine_end_to_done_p50_ms": 1000 * statistics.median(h[3] for h in seen),
                "n": len(seen),
            }

    def caches(self) -> None:
        """The stage-output cache (repeat the same jobs) and the first-block denoising cache."""
        from omni_jobs.engines.dit import DiTRequest

        nonce = int(time.time())  # the system's Redis keeps its cache across runs: new prompts, a cold cache
        texts = [f"{t} ({nonce})" for t in prompts(self.n, 999)]
        t0 = time.perf_counter()
        first = self.run_jobs("b-image-cached", texts)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = self.run_jobs("b-image-cached", texts)
        warm = time.perf_counter() - t0
        hits = sum(1 for j in again if j.stage_record("dit").metrics.get("cache_hit") == 1.0)
        self.results["cache"]["stage_cache"] = {
            "jobs": self.n, "first_run_s": cold, "repeat_run_s": warm, "speedup": cold / warm,
            "repeat_hits": hits, "first_hits": sum(1 for j in first if j.stage_record("dit").metrics.get("cache_hit")),
        }
        fbc: dict[str, Any] = {}
        reqs = [DiTRequest(f"c{i}", prompt=t, height=64, width=64, num_inference_steps=max(self.args.steps, 16),
                           seed=i) for i, t in enumerate(texts[: self.args.batch])]
        for label, cache in (("off", None), ("first_block_0.2", {"type": "first_block", "threshold": 0.2})):
            engine = self._dit(DIT_LARGE, cache)
            engine.generate(reqs[:2])
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = engine.generate(reqs)
                times.append(time.perf_counter() - t0)
            fbc[label] = {"s": statistics.median(times), "images": out}
        import numpy as np

        diff = max(float(np.abs(np.asarray(a.image, float) - np.asarray(b.image, float)).mean())
                   for a, b in zip(fbc["off"]["images"], fbc["first_block_0.2"]["images"], strict=True))
        self.results["cache"]["first_block_cache"] = {
            "batch": len(reqs), "steps": reqs[0].num_inference_steps, "off_s": fbc["off"]["s"],
            "on_s": fbc["first_block_0.2"]["s"], "speedup": fbc["off"]["s"] / fbc["first_block_0.2"]["s"],
            "max_mean_abs_pixel_diff": diff,
        }


class DirectProcess:
    """The direct arm in a child process that loads its engines once and then runs one repetition
    per request (lines on its stdin; JSON answers on its stdout behind a marker, since engines log there)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        import subprocess

        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "w") as log:  # the child keeps its own handle
            # the engine libraries set up as in a worker (OpenMP's spin, oneDNN's cache, the malloc): the same engine
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                          text=True, bufsize=1,
                                          env=engine_process_env(apply_engine_library_defaults(
                                              {**os.environ, **(env or {})})))
        self._read()  # {"ready": true} once loaded and warmed up

    @property
    def pid(self) -> int:
        return self._proc.pid

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def rep(self, rep: int) -> dict[str, Any]:
        return self.ask(str(rep))

    def ask(self, line: str) -> dict[str, Any]:
        """Send the child one request line; its answer."""
        self.send(line)
        return self.answer()

    def send(self, line: str) -> None:
        """Start the child on a request line without waiting (``answer`` reads the reply), so that
        two children can work at once."""
        assert self._proc.stdin
        self._proc.stdin.write(f"{line}\n")

    def answer(self) -> dict[str, Any]:
        return self._read()

    def close(self) -> dict[str, Any]:
        assert self._proc.stdin
        self._proc.stdin.write("quit\n")
        self._proc.stdin.close()
        last = self._read()
        self._proc.wait(timeout=120)
        return last

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout
        for line in self._proc.stdout:
            if line.startswith(_REPLY):
                return dict(json.loads(line[len(_REPLY):]))
        raise RuntimeError(f"the direct arm exited with {self._proc.wait()} before answering; see {self.log_path}")


class DirectGroup:
    """The direct arm's children (one, or one per engine worker with --engine-workers), started on a
    repetition together: its time is the last one's, its CPU all of theirs."""

    def __init__(self, children: list[DirectProcess]) -> None:
        self.children = children

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for c in self.children:
            c.__exit__(*exc)

    def rep(self, rep: int) -> dict[str, Any]:
        started = time.perf_counter()
        for c in self.children:
            c.send(str(rep))
        answers = [c.answer() for c in self.children]
        elapsed = time.perf_counter() - started
        jobs = sum(a["jobs_per_s"] * a["latency"] for a in answers)
        stages = {k for a in answers for k in a["stage_s"]}
        return {"jobs_per_s": jobs / elapsed, "latency": elapsed, "cpu_s": sum(a["cpu_s"] for a in answers),
                "stage_s": {k: max(a["stage_s"].get(k, 0.0) for a in answers) for k in stages}}

    def close(self) -> dict[str, Any]:
        peaks = [c.close()["rss_mib"]["driver"] for c in self.children]
        if len(peaks) == 1:
            return {"rss_mib": {"driver": peaks[0]}}
        return {"rss_mib": {f"driver-{i + 1}": p for i, p in enumerate(peaks)}}


_REPLY = "BENCH-DIRECT "


def _reply(data: dict[str, Any]) -> None:
    print(_REPLY + json.dumps(data), flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ratios(a: list[float], b: list[float]) -> list[float]:
    """a[i] / b[i]: repetition i of both arms ran back to back, under the same conditions."""
    return [x / y for x, y in zip(a, b, strict=True)]


def _cpu_split(system: Arm, direct: Arm, n: int) -> tuple[float, float]:
    """system/direct as two factors (medians of the per-repetition ratios): the CPU both arms used
    (every process of the machine that this benchmark started), direct over system, and the cores
    the system kept busy over those direct kept busy. On a machine whose cores the work fills, the
    first is the ratio that the system's own work allows; the second is time lost waiting."""
    def per_rep(arm: Arm) -> list[tuple[float, float]]:
        reps = len(arm.jobs_per_s)
        totals = [sum(v[i] for v in arm.cpu_s.values() if len(v) == reps) for i in range(reps)]
        return [(cpu, cpu / (n / jps)) for cpu, jps in zip(totals, arm.jobs_per_s, strict=True)]

    pairs = list(zip(per_rep(system), per_rep(direct), strict=True))
    return (statistics.median(d[0] / s[0] for s, d in pairs), statistics.median(s[1] / d[1] for s, d in pairs))


_BATCH_SERIES = {
    "omni_jobs_engine_batch_size_sum": "requests", "omni_jobs_engine_batch_size_count": "calls",
    "omni_jobs_engine_batch_run_seconds_count": "batches", "omni_jobs_engine_batch_run_seconds_sum": "run_s",
    "omni_jobs_engine_batch_wait_seconds_sum": "wait_s",
}
"""The worker metrics the benchmark reads around each repetition (Bench.batch_totals), by series name."""


def _engine_time_lines(system: Arm, direct: Arm, n: int) -> list[str]:
    """Where each system repetition of ``n`` jobs went, per worker: its span (first job created to last done),
    the time its engine ran batches, and the rest (the engine idle: before the first batch could
    start, between batches, after the last one). Beside it, the direct arm's engine call for the same
    work: run/direct above 1 is the same batches running slower beside the system's other work (its
    threads and processes take a core from the engine's OpenMP team). Where two engines share the
    cores (multi-stage), each one's idle time includes the other's turns."""
    lines = []
    for node, runs in system.engine_run_s.items():
        direct_s = direct.stage_s.get(node, [])
        parts = []
        for i, (run, rate) in enumerate(zip(runs, system.jobs_per_s, strict=False)):
            span = n / rate
            text = f"span {span:.3f} = engine {run:.3f} + idle {span - run:.3f} s"
            if i < len(direct_s):
                text += f" (direct {direct_s[i]:.3f}: run/direct {run / direct_s[i]:.3f})"
            parts.append(text)
        lines.append(f"engine time, {node}: " + "; ".join(parts))
    return lines


def _cpu_line(cpu_s: dict[str, float]) -> str:
    """The processes that used any CPU, as ``name=seconds``."""
    return " ".join(f"{k}={v:.2f}" for k, v in cpu_s.items() if v >= 0.01)


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(results: dict[str, Any]) -> str:
    header = (f"{'workload':32} {'arm':7} {'jobs/s':>8} {'p50 s':>7} {'p95 s':>7} {'stage s (median/job)':24} "
              f"{'peak RSS MiB':22} {'sys/direct':>10} {'sys/naive':>9}")
    lines = [header] if results["rows"] else []
    engine_cores = (results.get("config") or {}).get("engine_cores")
    if engine_cores:
        lines.insert(0, f"engines: {engine_cores} thread(s) each, in both arms (--engine-cores); the other cores the system's")
    engine_workers = (results.get("config") or {}).get("engine_workers") or 1
    if engine_workers > 1:
        lines.insert(0, f"engines: {engine_workers} workers per stage queue, each on its own cores, and the direct arm "
                        f"as {engine_workers} engine processes laid out alike (--engine-workers)")
    for name, row in results["rows"].items():
        for arm in ("direct", "system", "naive"):
            a = row[arm]
            stages = " ".join(f"{k}={v:.3f}" for k, v in a["stage_s"].items())
            rss = " ".join(f"{k}={v:.0f}" for k, v in a["peak_rss_mib"].items())
            ratio = (f"{row['system_over_direct']:>10.2f} {row['system_over_naive']:>9.2f}" if arm == "system" else "")
            lines.append(f"{name if arm == 'direct' else '':32} {arm:7} {_f(a['jobs_per_s']):>8} {_f(a['p50_s']):>7} "
                         f"{_f(a['p95_s']):>7} {stages:24} {rss:22} {ratio}")
    for name, p in results.get("previews", {}).items():
        lines.append(f"{name:32} previews every {p['preview_every']} of {p['steps']} steps "
                     f"({p['previews_per_job']}/job): off {_f(p['off']['jobs_per_s'])}, on {_f(p['on']['jobs_per_s'])} "
                     f"jobs/s, on/off {p['on_over_off']:.3f} (runs {p['on_over_off_runs']}); p50 off "
                     f"{_f(p['off']['p50_s'])} s, on {_f(p['on']['p50_s'])} s; dit worker CPU off/on "
                     f"{_f(p['worker_cpu_off_over_on'], '{:.3f}')}; engine alone: on/off {p['engine']['on_over_off']:.3f}, "
                     f"CPU off/on {p['engine']['cpu_off_over_on']:.3f}, one preview {p['engine']['preview_cpu_ms']:.2f} ms "
                     f"CPU = {p['engine']['preview_share_of_engine_cpu']:.2%} of a job's engine CPU; "
                     f"a preview is {p['preview_base64_bytes']} bytes of base64")
    if results["rows"]:
        lines.append("\nwhere the CPU went (seconds per repetition, median; 2 cores; direct: its process, then the "
                     "system's, idle meanwhile) and how long the clients took to submit; sys/direct = CPU direct/system "
                     "x busy cores system/direct:")
    for name, row in results["rows"].items():
        span = row["system"].get("submit_span_s")
        lines.append(f"  {name:32} direct {_cpu_line(row['direct']['cpu_s'])} | system {_cpu_line(row['system']['cpu_s'])}"
                     + (f" | submit span {span:.2f} s" if span is not None else ""))
        if row.get("cpu_direct_over_system") is not None:
            lines.append(f"  {'':32} sys/direct {row['system_over_direct']:.2f} = CPU {row['cpu_direct_over_system']:.2f}"
                         f" x busy cores {row['busy_cores_system_over_direct']:.2f}")
    config = results.get("config", {})
    b_label = " ".join([*(config.get("ab") or []), *([f"code of {config['ab_tree']}"] if config.get("ab_tree") else [])])
    for arm, label in (("hops", "system"), ("hops_b", f"B {b_label}")):
        h = results.get(arm) or {}
        if h:
            lines.append(f"per-hop queue overhead, {label} (p50 of {h['n']} jobs, idle system): API->worker "
                         f"{h['api_to_worker_p50_ms']:.1f} ms, worker->next stage {h['worker_to_next_stage_p50_ms']:.1f} "
                         f"ms, last stage->results done {h['stage_to_results_done_p50_ms']:.1f} ms (its engine's "
                         f"end->done {h.get('engine_end_to_done_p50_ms', float('nan')):.1f} ms)")
    c = results.get("cache") or {}
    if "stage_cache" in c:
        s = c["stage_cache"]
        lines.append(f"stage-output cache: {s['jobs']} jobs first run {s['first_run_s']:.2f} s, repeated "
                     f"{s['repeat_run_s']:.2f} s ({s['speedup']:.1f}x; {s['repeat_hits']}/{s['jobs']} hits)")
    if "first_block_cache" in c:
        f = c["first_block_cache"]
        lines.append(f"diffusers first-block cache (threshold 0.2, batch {f['batch']}, {f['steps']} steps, 64px large): "
                     f"off {f['off_s']:.2f} s, on {f['on_s']:.2f} s ({f['speedup']:.2f}x; mean |pixel diff| "
                     f"<= {f['max_mean_abs_pixel_diff']:.1f}/255)")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few jobs, one repetition (about 2 minutes)")
    p.add_argument("--jobs", type=int, default=None, help="jobs per arm and repetition (default 64; quick 8)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per arm (default 3; quick 1)")
    p.add_argument("--batch", type=int, default=None, help="max batch size of the stage workers (default 32)")
    p.add_argument("--ar-tokens", type=int, default=32, help="new tokens per text-to-text job")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per image (PixArt-Sigma's usual 20)")
    p.add_argument("--only", nargs="*", default=None, help="workload names (substring match) to run")
    p.add_argument("--out", type=Path, default=ROOT / "results", help="where the JSON goes")
    p.add_argument("--previews", type=int, nargs="?", const=5, default=None, metavar="N",
                   help="measure only what DiT previews cost: preview_every 0 vs N (default 5), side by side")
    p.add_argument("--ab", nargs="+", default=None, metavar="KEY=VALUE",
                   help="a B arm: the same system arm on twin workers with these settings (e.g. "
                        "OMNI_BATCH_FILL_WAIT_MS=0), paired with the system arm in every repetition")
    p.add_argument("--ab-tree", type=Path, default=None, metavar="PATH",
                   help="a B arm running another checkout's code (e.g. `git worktree add /tmp/base HEAD~3`) with the "
                        "same settings (or --ab's): two versions paired in every repetition. The API, Redis and "
                        "the other workers stay this checkout's")
    p.add_argument("--no-naive", action="store_true", help="skip the naive arm (shorter A/B runs)")
    p.add_argument("--hops", action="store_true", help="measure only the per-hop overhead (with --ab: both arms)")
    p.add_argument("--rows-only", action="store_true",
                   help="only the workload rows: no per-hop overhead or cache effects after them (A/B and "
                        "steady-state runs, e.g. --jobs 256, ~3 minutes shorter)")
    p.add_argument("--engine-cores", type=int, default=None, metavar="N",
                   help="each engine, in both arms, runs N threads (vLLM's bound to cores 0..N-1), so that the "
                        "other cores are the system's: its cost where the CPU is not the engine's, as on a GPU "
                        "host (default: the engines use every core)")
    p.add_argument("--engine-workers", type=int, default=1, metavar="N",
                   help="N worker processes per stage queue in the system, each on its own slice of the cores "
                        "(omni-jobs up --engine-workers), and the direct arm as N engine processes laid out alike, "
                        "each doing its share of the jobs (default 1: one engine on every core)")
    p.add_argument("--redis-durability", choices=("auto", "always", "waitaof", "everysec"), default="auto",
                   help="how the system's Redis keeps a 202 (auto: as `omni-jobs up`; see EmbeddedSystem)")
    p.add_argument("--direct", default=None, help=argparse.SUPPRESS)  # internal: one direct arm, JSON out
    p.add_argument("--direct-part", default="0/1", help=argparse.SUPPRESS)  # internal: which share of the jobs
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    if args.engine_workers < 1:
        p.error(f"--engine-workers {args.engine_workers}: give 1 or more")
    if args.engine_workers > 1 and args.engine_cores is not None:
        p.error("--engine-workers and --engine-cores: choose one (each lays out the engines' cores its own way)")
    if args.engine_cores is not None and not 1 <= args.engine_cores < cores:
        p.error(f"--engine-cores {args.engine_cores}: give the engines 1 to {cores - 1} of this machine's {cores} "
                "cores, leaving at least one to the system")
    if args.rows_only and (args.hops or args.previews is not None):
        p.error("--rows-only runs the workload rows, which --hops and --previews skip: choose one")
    if args.ab_tree is not None:
        if not (args.ab_tree / "workers" / "app.py").is_file():
            p.error(f"--ab-tree {args.ab_tree}: no omni-jobs checkout there (workers/app.py is missing)")
        args.ab = args.ab or []
    args.jobs = args.jobs or (8 if args.quick else 64)
    args.reps = args.reps or (1 if args.quick else 3)
    args.batch = args.batch or (8 if args.quick else 32)
    args.hop_jobs = 5 if args.quick else 15 if not args.hops else 31
    return args


def engine_cores_env(n: int) -> dict[str, str]:
    """The environment that gives an engine process n threads: torch's (diffusers) through OpenMP's count,
    vLLM's CPU engine through its own binding (it sets OpenMP's count and pins the threads to those cores).
    Both arms' engine processes inherit it from the benchmark's process."""
    return {"OMP_NUM_THREADS": str(n), "VLLM_CPU_OMP_THREADS_BIND": "0" if n == 1 else f"0-{n - 1}"}


def as_engine_process() -> None:
    """Run this process's engines as the system's workers run theirs: the same engine library settings,
    set before torch loads, and the same malloc (tcmalloc preloaded where installed, so this process
    starts again once with it; else glibc's thresholds). A direct child started with
    ``engine_process_env`` already has both and goes on at once. Without this, on the CPU, bench.gpu_dit's
    direct arm ran at 20 images/s where this module's direct child ran 25."""
    env = engine_process_env(apply_engine_library_defaults(dict(os.environ)))
    if env.get("LD_PRELOAD", "") != os.environ.get("LD_PRELOAD", "") and not loaded_tcmalloc():
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(env))  # this same command
    apply_engine_library_defaults()
    tune_engine_malloc(malloc_choice())


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # a kill stops what it started (the finally blocks, atexit)
    args = parse(argv)
    bench = Bench(args)
    if args.direct:
        (w,) = [w for w in WORKLOADS if w.name == args.direct]
        bench.serve_direct(w)
        return 0
    started = time.time()
    if args.engine_cores is not None:
        os.environ.update(engine_cores_env(args.engine_cores))  # before the workers and the direct child start
    try:
        bench.start()
        if args.previews is not None:
            bench.previews()
        elif args.hops:
            bench.hops()
        else:
            for w in WORKLOADS:
                if args.only is None or any(o in w.name for o in args.only):
                    bench.row(w)
            if not args.rows_only:
                bench.hops()
                bench.caches()
    finally:
        bench.stop()
    bench.results["wall_s"] = time.time() - started
    print("\n" + table(bench.results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(bench.results, indent=2, default=str))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
