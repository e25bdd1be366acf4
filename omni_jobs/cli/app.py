"""The ``omni-jobs`` command: run the whole system locally, build tiny models, check pipelines, and
submit, follow, list and cancel jobs on a running API."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from omni_jobs.cli.jobs import add_job_commands
from omni_jobs.cli.keys import add_key_commands
from omni_jobs.cli.run import add_run_command
from omni_jobs.core.errors import PipelineSpecError
from omni_jobs.core.settings import load_settings
from omni_jobs.local import tiny
from omni_jobs.pipelines.catalogue import load_catalogue, load_pipeline_file

DEMO_PROMPT = "a lighthouse on a cliff at sunset, oil painting"


def _wait_for_job(client: httpx.Client, job_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        where = f"{job['status']} {job.get('stage') or ''} {job.get('progress') or ''}".strip()
        if where != last:
            print(f"  {job_id}: {where}", flush=True)
            last = where
        if job["status"] in ("succeeded", "failed", "canceled"):
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not finish within {timeout_s:.0f}s (last: {where})")
        time.sleep(0.2)


def run_demo_job(api_url: str, out_dir: Path, prompt: str, timeout_s: float = 300,
                 api_key: str | None = None) -> dict[str, Any]:
    """Submit one text-to-image job over HTTP, wait for it, save its PNG and JSON under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=api_url, timeout=30, headers=headers) as client:
        body = {"pipeline": "text-to-image", "input": {"prompt": prompt}, "params": {"dit": {"seed": 0}}}
        job = client.post("/v1/jobs", json=body).raise_for_status().json()
        print(f"submitted {job['id']} (text-to-image): {prompt!r}")
        job = _wait_for_job(client, job["id"], timeout_s)
        job_path = out_dir / f"{job['id']}.json"
        job_path.write_text(json.dumps(job, indent=2))
        print(f"job JSON:  {job_path.resolve()}")
        if job["status"] != "succeeded":
            print(f"job {job['status']}: {job.get('error')}", file=sys.stderr)
            return job
        for out in job["outputs"]:
            if out["type"] == "image":
                png = out_dir / f"{job['id']}-{out['name']}.png"
                own = out["url"].startswith(api_url)  # the API wants the key; a presigned store URL must not get it
                png.write_bytes((client.get(out["url"]) if own else httpx.get(out["url"], timeout=30))
                                .raise_for_status().content)
                print(f"image:     {png.resolve()}  ({out['width']}x{out['height']}, {out['size']} bytes)")
            elif out["type"] == "text":
                print(f"AR text:   {out['text']!r}")
                print("           (tiny: models have random weights: their text and images are noise by design)")
        for stage in job["stages"]:
            print(f"stage {stage['id']:<4} {stage['status']} in {stage['duration_s']:.3f}s on {stage['worker']}")
    return job


def cmd_up(args: argparse.Namespace) -> int:
    from omni_jobs.local.embedded import EmbeddedSystem, HomeInUse, RedisUnreachable

    settings = load_settings()
    home = Path(args.home)
    if "artifacts_dir" not in settings.model_fields_set:
        # Beside the Redis data that points at them, not under whichever directory the shell was in.
        settings = settings.model_copy(update={"artifacts_dir": home / "artifacts"})
    extra_env: dict[str, str] = {}
    if args.pipelines:  # checked here, so that a bad file is reported before anything starts
        paths = [*settings.pipelines_path, *(Path(p).resolve() for p in args.pipelines)]
        try:
            load_catalogue(paths)
        except PipelineSpecError as exc:
            print(exc, file=sys.stderr)
            return 2
        extra_env["OMNI_PIPELINES_PATH"] = json.dumps([str(p) for p in paths])
    system = EmbeddedSystem(settings=settings, home=home, api_port=args.api_port, flower_port=args.flower_port,
                            redis_url=settings.redis_url if "OMNI_REDIS_URL" in os.environ else None,
                            extra_env=extra_env, engine_workers=args.engine_workers,
                            redis_replicas=max(0, args.replicas))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        system.start()
        print(f"API:       {system.api_url}   (docs: {system.api_url}/docs)")
        print(f"Flower:    {system.flower_url}   (user {system.flower_user}, password {system.flower_password})")
        print(f"webhooks:  signed with the secret in {system.webhook_secret_file.resolve()}")
        if system.api_key:
            print(f"API key:   {system.api_key}   (tenant {system.demo_tenant}; also in "
                  f"{system.api_key_file.resolve()}; send it as 'Authorization: Bearer <key>')")
        print(f"logs:      {system.logs.resolve()}")
        print(f"CLI:       . {system.cli_env_file.resolve()}   (in another shell: then omni-jobs list, doctor, "
              "keys ... use this system)")
        print(f"metrics:   {system.api_url}/metrics, workers: "
              + ", ".join(f"{node} http://127.0.0.1:{port}/metrics" for node, port in system.metrics_ports.items()))
        job = run_demo_job(system.api_url, home / "demo", args.prompt, api_key=system.api_key)
        if job["status"] != "succeeded":
            return 1
        if args.once:
            return 0
        print("\nThe system keeps running for more jobs, e.g.:")
        auth = f"-H 'authorization: Bearer {system.api_key}' " if system.api_key else ""
        print(f"  curl -s -X POST {system.api_url}/v1/jobs {auth}-H 'content-type: application/json' "
              f"-d '{{\"pipeline\": \"text-to-image\", \"input\": {{\"prompt\": \"a cat\"}}}}'")
        print("Press Ctrl-C to stop everything.")
        while True:
            time.sleep(1)
            # Like compose's restart policy: a worker that ended itself (hard time limit) or was
            # killed, the API, or this system's Redis (from its AOF) starts again.
            system.supervise(say=lambda msg: print(msg, file=sys.stderr))
    except (HomeInUse, RedisUnreachable) as exc:
        print(f"omni-jobs up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    finally:
        system.stop()


def cmd_tiny(args: argparse.Namespace) -> int:
    return tiny.main(["build", "--out", args.out, "--name", args.name])


def cmd_cleanup(args: argparse.Namespace) -> int:
    from omni_jobs.dispatch.retention import cleanup
    from omni_jobs.runtime import Runtime

    rt = Runtime(load_settings())
    s = rt.settings
    report = cleanup(rt.ledger, rt.artifacts, output_ttl_s=s.output_ttl_s, intermediate_ttl_s=s.intermediate_ttl_s,
                     reaper=rt.reaper)
    print(json.dumps(report.__dict__))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Versions against their ranges, devices, and whether Redis, the store and the workers answer."""
    from omni_jobs.cli.doctor import format_report, run_doctor

    report = run_doctor(load_settings(), services=not args.no_services, devices=not args.no_devices)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def cmd_pipelines(args: argparse.Namespace) -> int:
    try:
        if args.action == "check":
            if not args.files:
                print("omni-jobs pipelines check: name the YAML files to check", file=sys.stderr)
                return 2
            invalid = 0
            for path in args.files:  # every file's problems in one run, not the first file's alone
                try:
                    spec = load_pipeline_file(Path(path))
                except PipelineSpecError as exc:
                    print(exc, file=sys.stderr)
                    invalid += 1
                    continue
                print(f"{path}: ok ({spec.name}: {' -> '.join(s.id for s in spec.stages)})")
            return 2 if invalid else 0
        for spec in load_catalogue([*load_settings().pipelines_path, *(Path(p) for p in args.pipelines)]):
            print(f"{spec.name:<24} {' -> '.join(f'{s.id}[{s.engine}]' for s in spec.stages)}")
        return 0
    except PipelineSpecError as exc:
        print(exc, file=sys.stderr)
        return 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, 1 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-jobs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, the API, workers and Flower locally and run a demo job")
    up.add_argument("--home", default="var/embedded",
                    help="where logs, Redis data, job outputs (unless OMNI_ARTIFACTS_DIR) and demo files go")
    up.add_argument("--api-port", type=int, default=8000)
    up.add_argument("--flower-port", type=int, default=5555)
    up.add_argument("--prompt", default=DEMO_PROMPT)
    up.add_argument("--once", action="store_true", help="stop after the demo job instead of waiting for Ctrl-C")
    up.add_argument("--pipelines", action="append", default=[], metavar="PATH",
                    help="your pipeline YAML files or directories (repeatable; added to OMNI_PIPELINES_PATH)")
    up.add_argument("--engine-workers", type=_positive_int, default=1, metavar="N",
                    help="worker processes per stage queue (ar, dit), each on its own share of the CPUs: on a CPU "
                         "host one per core gives the most jobs a second (a model copy each; a single job runs on "
                         "its share). Default 1: one worker per queue on every CPU")
    up.add_argument("--replicas", type=int, default=0, metavar="N",
                    help="run N replicas of Redis and 3 Sentinels; every process follows the primary through a "
                         "failover, and submits wait for a replica (docs/reliability.md, \"Redis failover\"). Default 0")
    up.set_defaults(func=cmd_up)

    t = sub.add_parser("tiny", help="build the small random-weight models used by the demo and tests")
    t.add_argument("action", choices=["build"])
    t.add_argument("--out", default=str(load_settings().models_dir))
    t.add_argument("--name", default="all")
    t.set_defaults(func=cmd_tiny)

    c = sub.add_parser("cleanup", help="delete expired jobs and artifacts; cancel jobs past their deadline")
    c.set_defaults(func=cmd_cleanup)

    p = sub.add_parser("pipelines", help="list the pipelines, or check pipeline YAML files")
    p.add_argument("action", nargs="?", choices=["list", "check"], default="list",
                   help="list (the default) or check FILES")
    p.add_argument("files", nargs="*", help="check: the pipeline YAML files or directories")
    p.add_argument("--pipelines", action="append", default=[], metavar="PATH",
                   help="list: also these pipeline YAML files or directories")
    p.set_defaults(func=cmd_pipelines)

    d = sub.add_parser("doctor", help="check library versions, devices, Redis, the artifact store and workers")
    d.add_argument("--json", action="store_true", help="print the checks as JSON")
    d.add_argument("--no-services", action="store_true", help="only versions and devices (no Redis, S3, workers)")
    d.add_argument("--no-devices", action="store_true", help="skip the device check (it imports torch)")
    d.set_defaults(func=cmd_doctor)

    add_key_commands(sub)  # keys create | revoke | list (omni_jobs.cli.keys)
    add_job_commands(sub)  # submit, status, list, cancel, download, webhook-secret (omni_jobs.cli.jobs)
    add_run_command(sub)  # run: one job in this process, no services (omni_jobs.cli.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
