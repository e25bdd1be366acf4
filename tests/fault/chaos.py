"""The chaos run: hundreds of jobs while every kind of process is SIGKILLed at random moments.

    python -m tests.fault.chaos [--jobs 200] [--seed 7] [--home var/chaos]

It starts the system as ``omni-jobs up`` does, with its defaults (its own Redis with AOF and
appendfsync always, local artifacts, the hour-long visibility timeout, 15 s leases), and a
supervisor that restarts whatever dies, as ``omni-jobs up`` and compose do. While clients submit a
mix of text-to-image, text-to-text and webhook jobs (each with an Idempotency-Key, retried on a
connection error or a 503 as a careful client would), it SIGKILLs the DiT worker twice, the AR
worker, the results worker, the webhooks worker, the API, and Redis (restarted from its AOF 2 s
later), each at a random moment. Then it counts, from what the outside sees:

- accepted: jobs answered 202; missing: accepted, then unknown to the API;
- succeeded, unfinished (not final 60 s after the last fault);
- duplicated engine runs: a stage attempt whose engine started twice (the workers' run journal);
- duplicated or missing webhooks: a job and event with more or fewer than one webhook id (counted
  once all have arrived, or 45 s after the last job's end: a delivery held by a killed webhooks
  worker goes out again when its lease runs out; a missing one is listed with its job's deliveries);
- duplicated output files: files under a job's outputs beyond the pipeline's outputs;
- time from the last fault to the last job's end.

It prints the table and exits 1 unless: accepted = succeeded, nothing missing or duplicated, and
every job done within 60 s of the last fault. ``tests/fault/test_chaos.py`` runs it under pytest
(marker ``chaos``, not in the default run).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import free_port
from omni_jobs.local.embedded import EmbeddedSystem
from omni_jobs.run.run_journal import read_journal
from tests.webhook_receiver import WebhookReceiver

REPO = Path(__file__).resolve().parents[2]
FAULTS = ["worker-dit", "worker-dit", "worker-ar", "worker-results", "worker-webhooks", "api", "redis-server"]
REDIS_DOWN_S = 2.0
DONE_WITHIN_S = 60.0
OUTPUTS = {"text-to-image": 2, "text-to-text": 1}
WEBHOOK_EVENTS = ("start", "completed")
WEBHOOKS_WITHIN_S = 45.0
"""How long after the last job's end its webhooks may still arrive: a lease (15 s) and the reaper's
pass, twice over."""


@dataclass
class Fault:
    process: str
    at: float = 0.0


@dataclass
class ChaosResult:
    accepted: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    webhook_jobs: set[str] = field(default_factory=set)
    faults: list[Fault] = field(default_factory=list)
    final: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    duplicate_runs: int = 0
    duplicate_webhooks: int = 0
    missing_webhooks: int = 0
    duplicate_files: int = 0
    last_done_after_last_fault_s: float = 0.0
    refused: Counter[int] = field(default_factory=Counter)
    missing_webhook_jobs: set[str] = field(default_factory=set)
    findings: list[str] = field(default_factory=list)
    """Each counted loss or duplicate, naming its job (printed under the table, to start from)."""

    @property
    def succeeded(self) -> int:
        return sum(j["status"] == "succeeded" for j in self.final.values())

    @property
    def unfinished(self) -> int:
        return sum(j["status"] not in ("succeeded", "failed", "canceled") for j in self.final.values())

    @property
    def ok(self) -> bool:
        return (len(self.accepted) == self.succeeded and not self.missing and self.duplicate_runs == 0
                and self.duplicate_webhooks == 0 and self.missing_webhooks == 0 and self.duplicate_files == 0
                and self.last_done_after_last_fault_s <= DONE_WITHIN_S)

    def table(self) -> str:
        rows = [
            ("jobs accepted (202)", len(self.accepted)),
            ("  text-to-image / text-to-text / with webhooks",
             (f"{sum(k == 'text-to-image' for k in self.kinds.values())} / "
             f"{sum(k == 'text-to-text' for k in self.kinds.values())} / {len(self.webhook_jobs)}")),
            ("succeeded", self.succeeded),
            ("answered 202, then missing", len(self.missing)),
            ("unfinished", self.unfinished),
            ("duplicated engine runs (same stage attempt)", self.duplicate_runs),
            ("duplicated webhooks (a job's event, 2+ ids)", self.duplicate_webhooks),
            ("missing webhooks", self.missing_webhooks),
            ("duplicated output files", self.duplicate_files),
            ("last job done, after the last fault", f"{self.last_done_after_last_fault_s:.1f} s"),
            ("faults (SIGKILL at s after start)", ", ".join(f"{f.process}@{f.at:.1f}" for f in self.faults)),
            ("client retries (status: count)", dict(self.refused) or "none"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = ["| what | count |", "|---|---|"] + [f"| {name:<{width}} | {value} |" for name, value in rows]
        return "\n".join(lines + [f"  {finding}" for finding in self.findings])


def _client_submit(api: httpx.Client, body: dict[str, Any], result: ChaosResult, lock: threading.Lock) -> str:
    """POST until answered, with one Idempotency-Key: a crash mid-request never makes two jobs."""
    key = uuid.uuid4().hex
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
        except httpx.HTTPError:
            with lock:
                result.refused[0] += 1
            time.sleep(0.5)
            continue
        if r.status_code == 202 or (r.status_code == 200 and "id" in r.json()):
            return str(r.json()["id"])
        with lock:
            result.refused[r.status_code] += 1
        time.sleep(float(r.headers.get("retry-after", "1")) if r.status_code in (503, 429) else 0.5)
    raise RuntimeError(f"could not submit {body['pipeline']} in 120 s")


def start_supervisor(system: EmbeddedSystem, held_down: set[str], stop: threading.Event, say: Any, *,
                     name: str) -> None:
    """What `omni-jobs up` does, every half second until ``stop``: start again every process of ``system`` that
    is not running, but those ``held_down`` (killed on purpose, kept down for a while)."""

    def supervise() -> None:
        while not stop.wait(0.5):
            for proc in list(system.processes):
                if not proc.running and proc.name not in held_down:
                    try:
                        proc.start()
                    except Exception as exc:  # noqa: BLE001 - try again at the next round
                        say(f"  [supervisor] {proc.name} did not start: {exc}")

    threading.Thread(target=supervise, name=name, daemon=True).start()


def run(jobs: int = 200, seed: int = 7, home: Path | None = None, say: Any = print,
        engine_workers: int = 1) -> ChaosResult:
    rng = random.Random(seed)
    home = (home or REPO / "var" / "chaos").resolve()
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    journal = home / "engine-runs.jsonl"
    settings = Settings(models_dir=REPO / "var" / "models", artifacts_dir=home / "artifacts")
    result = ChaosResult()
    lock = threading.Lock()
    with WebhookReceiver() as receiver:
        hook = receiver.script("/chaos", [])
        system = EmbeddedSystem(settings=settings, home=home, api_port=free_port(), with_flower=False,
                                engine_workers=engine_workers, extra_env={"OMNI_RUN_JOURNAL": str(journal),
                                           "OMNI_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]'})
        system.start(say=lambda m: say(f"  [system] {m}"))
        held_down: set[str] = set()
        stop = threading.Event()

        start_supervisor(system, held_down, stop, say, name="chaos-supervisor")
        api = httpx.Client(base_url=system.api_url, timeout=30,
                           headers={"authorization": f"Bearer {system.api_key}"} if system.api_key else {})
        try:
            started = time.monotonic()
            submit_window = max(20.0, jobs / 6)
            # with a worker per core, each stage queue's second worker is killed too
            faults = FAULTS + [f"worker-{q}-{i + 1}" for q in ("dit", "ar") for i in range(1, engine_workers)]
            schedule = sorted((rng.uniform(3.0, submit_window), name) for name in faults)
            result.faults = [Fault(name, at) for at, name in schedule]

            def chaos_monkey() -> None:
                for fault in result.faults:
                    time.sleep(max(0.0, started + fault.at - time.monotonic()))
                    proc = next(p for p in system.processes if p.name == fault.process)
                    say(f"  [chaos] SIGKILL {fault.process} at {time.monotonic() - started:.1f}s")
                    if fault.process == "redis-server":
                        held_down.add(fault.process)
                        proc.kill()
                        time.sleep(REDIS_DOWN_S)
                        proc.start()  # from its AOF
                        held_down.discard(fault.process)
                    else:
                        proc.kill()
                    fault.at = time.monotonic() - started

            monkey = threading.Thread(target=chaos_monkey, name="chaos-monkey", daemon=True)
            monkey.start()

            def one(i: int) -> None:
                time.sleep(max(0.0, started + i * submit_window / jobs - time.monotonic()))
                kind = rng_choice[i]
                body: dict[str, Any] = {"pipeline": kind, "input": {"prompt": f"chaos {i}"}}
                if kind == "text-to-image":
                    body["params"] = {"ar": {"max_tokens": 4}, "dit": {"height": 64, "width": 64,
                                                                       "num_inference_steps": 8, "seed": i}}
                else:
                    body["params"] = {"ar": {"max_tokens": 8, "seed": i}}
                if i in with_hooks:
                    body["webhook"] = hook
                    body["webhook_events_filter"] = list(WEBHOOK_EVENTS)
                job_id = _client_submit(api, body, result, lock)
                with lock:
                    result.accepted.append(job_id)
                    result.kinds[job_id] = kind
                    if i in with_hooks:
                        result.webhook_jobs.add(job_id)

            rng_choice = [("text-to-image" if rng.random() < 0.6 else "text-to-text") for _ in range(jobs)]
            with_hooks = {i for i in range(jobs) if rng.random() < 0.3}
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(one, range(jobs)))
            monkey.join()
            last_fault = started + max(f.at for f in result.faults)
            say(f"  [chaos] all submitted; last fault at {last_fault - started:.1f}s; waiting for the jobs ...")
            _wait_all(api, result, deadline=last_fault + DONE_WITHIN_S + 60)
            ends = [j["completed_at"] for j in result.final.values() if j.get("completed_at")]
            wall_last_fault = time.time() - (time.monotonic() - last_fault)
            result.last_done_after_last_fault_s = max(0.0, max(ends, default=0.0) - wall_last_fault)
            _wait_webhooks(result, receiver, deadline=time.monotonic() + WEBHOOKS_WITHIN_S)
            time.sleep(3)  # late duplicates and journal lines land
            _count_effects(result, journal, receiver, settings.artifacts_dir)
            _explain_missing_webhooks(api, result)
        finally:
            stop.set()
            api.close()
            system.stop()
    return result


def _wait_all(api: httpx.Client, result: ChaosResult, deadline: float) -> None:
    pending = list(result.accepted)
    while pending and time.monotonic() < deadline:
        still = []
        for job_id in pending:
            try:
                r = api.get(f"/v1/jobs/{job_id}")
            except httpx.HTTPError:
                still.append(job_id)
                continue
            if r.status_code == 404:
                result.missing.append(job_id)
                continue
            job = r.json()
            result.final[job_id] = job
            if job["status"] not in ("succeeded", "failed", "canceled"):
                still.append(job_id)
        pending = still
        if pending:
            time.sleep(1)


def _received_events(receiver: WebhookReceiver) -> dict[tuple[str, str], set[str]]:
    """(job id, event) -> the webhook ids the receiver got for it."""
    ids: dict[tuple[str, str], set[str]] = defaultdict(set)
    for received in receiver.at("/chaos"):
        ids[(json.loads(received.body)["id"], received.headers.get("omni-webhook-event", ""))].add(received.message_id)
    return ids


def _wait_webhooks(result: ChaosResult, receiver: WebhookReceiver, deadline: float) -> None:
    """Until every webhook job's events have arrived (or the deadline): a delivery that a SIGKILLed
    webhooks worker held is sent again only once its lease runs out, after its job has ended."""
    expected = {(job_id, event) for job_id in result.webhook_jobs for event in WEBHOOK_EVENTS}
    while time.monotonic() < deadline and not expected <= set(_received_events(receiver)):
        time.sleep(0.5)


def _explain_missing_webhooks(api: httpx.Client, result: ChaosResult) -> None:
    """For each missing webhook, what the job says of its deliveries (attempts, status codes, errors)."""
    for job_id in sorted(result.missing_webhook_jobs):
        try:
            deliveries = api.get(f"/v1/jobs/{job_id}").json().get("webhook", {}).get("deliveries", [])
        except (httpx.HTTPError, ValueError) as exc:
            deliveries = [f"unreadable: {exc}"]
        result.findings.append(f"{job_id}: deliveries {json.dumps(deliveries)}")


def _count_effects(result: ChaosResult, journal: Path, receiver: WebhookReceiver, artifacts: Path) -> None:
    starts = Counter((str(line["slot"]), int(line["attempt"]))  # type: ignore[call-overload]
                     for line in read_journal(journal) if line["event"] == "engine.start")
    result.duplicate_runs = sum(n - 1 for n in starts.values() if n > 1)
    result.findings += [f"{slot} attempt {attempt}: its engine started {n} times"
                        for (slot, attempt), n in starts.items() if n > 1]
    ids = _received_events(receiver)
    for job_id in result.webhook_jobs:
        for event in WEBHOOK_EVENTS:
            n = len(ids.get((job_id, event), set()))
            result.duplicate_webhooks += max(0, n - 1)
            if n == 0:
                result.missing_webhooks += 1
                result.missing_webhook_jobs.add(job_id)
            if n != 1:
                result.findings.append(f"{job_id}: {n} webhook ids for its '{event}' event")
    for job_id in result.accepted:
        outputs = artifacts / "jobs" / job_id / "outputs"
        # files, at any depth: an attempt after the first writes under a directory of its own (omni_jobs.report.results)
        names = sorted(p.relative_to(outputs).as_posix() for p in outputs.rglob("*") if p.is_file()) \
            if outputs.exists() else []
        expected = OUTPUTS[result.kinds[job_id]]
        if result.final.get(job_id, {}).get("status") == "succeeded":
            result.duplicate_files += abs(len(names) - expected)
            if len(names) != expected:
                result.findings.append(f"{job_id}: {len(names)} output files, {expected} expected: {names}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--home", type=Path, default=REPO / "var" / "chaos")
    parser.add_argument("--engine-workers", type=int, default=1, metavar="N",
                        help="N workers per stage queue, each on its own cores (omni-jobs up --engine-workers)")
    args = parser.parse_args(argv)
    result = run(args.jobs, args.seed, args.home, engine_workers=args.engine_workers)
    print("\n" + result.table())
    print("\nPASS" if result.ok else "\nFAIL")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
