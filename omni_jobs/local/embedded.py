"""The embedded system: every omni-jobs process on this machine, started and stopped together.

``omni-jobs up`` uses it so that a newcomer gets Redis, the API, one worker per queue and Flower
with one command; a user who already runs Redis points OMNI_REDIS_URL at it and none is started.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shlex
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from omni_jobs.core.redis_clients import redis_client
from omni_jobs.core.settings import Settings
from omni_jobs.dispatch.worker_registry import live_workers
from omni_jobs.engines.allocator import engine_process_env
from omni_jobs.engines.cpu_layout import engine_slice, host_cpus
from omni_jobs.jobs.steps import STAGE_QUEUES, WORKER_QUEUES
from omni_jobs.local.devservices import (
    RunningService,
    find_waitaof_server,
    free_port,
    require_waitaof_server,
    start_redis,
)
from omni_jobs.local.ha import RedisHA, start_redis_ha
from omni_jobs.local.tiny import TINY_MODELS, ensure_tiny_model
from omni_jobs.report.webhooks import generate_secret

WORKER_CONCURRENCY: dict[str, int] = {"webhooks": 8}
"""Queue -> tasks at once (default 1; stage queues: the stage_max_in_flight setting)."""


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                status: int = resp.status  # urlopen's answer is typed Any (an HTTPResponse here)
                return 200 <= status < 500
        except OSError:
            return False

    return check


DURABILITY_SAID = {
    "always": "AOF fsynced before every reply",
    "waitaof": "AOF fsynced every second, and before each 202",
    "everysec": "AOF fsynced every second: up to a second of 202s lost in a crash",
}


def redis_durability(asked: str) -> tuple[str, str | None]:
    """(mode, server binary) for a private Redis: ``asked`` ('auto', 'always', 'waitaof', 'everysec'),
    with 'auto' made concrete. 'waitaof' answers only submits after their fsync, and every other write
    at once (a stage starting, its progress, its result: ~0.4 ms less per hop here, docs/decisions/waitaof.md); it
    needs a server with WAITAOF, and 'auto' takes it only where one is installed and
    OMNI_REDIS_WAIT_AOF is not turned off."""
    if asked not in ("auto", *DURABILITY_SAID):
        raise ValueError(f"redis durability must be auto, always, waitaof or everysec, not {asked!r}")
    if asked == "auto":
        turned_off = os.environ.get("OMNI_REDIS_WAIT_AOF", "").strip().lower() in ("0", "false", "no", "off")
        binary = None if turned_off else find_waitaof_server()
        return ("waitaof", binary) if binary else ("always", None)
    if asked == "waitaof":
        return "waitaof", require_waitaof_server()
    return asked, None


def start_job_redis(data_dir: Path, durability: str) -> tuple[RunningService, str]:
    """The private Redis that keeps the jobs, with AOF fsynced as ``durability`` asks (``redis_durability``);
    returns it and the mode taken. A WAITAOF server ticks at ``WAITAOF_HZ``: a submit's wait ends sooner."""
    mode, binary = redis_durability(durability)
    service = start_redis(data_dir=data_dir, appendonly=True, binary=binary,
                          appendfsync="always" if mode == "always" else "everysec",
                          waitaof=mode == "waitaof")
    return service, mode


def _write_private(path: Path, text: str) -> None:
    """A file only its owner reads (a key, a secret): made 0600 before anything is written to it."""
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(text)


def _check_reachable(redis_url: str) -> None:
    client = redis_client(redis_url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnreachable(
            f"cannot reach Redis at {redis_url} (OMNI_REDIS_URL): {str(exc).rstrip('.')}. Start it, or "
            "unset OMNI_REDIS_URL to have one started here (a shell that sourced a stopped system's env "
            "file still has its URL)") from None
    finally:
        client.close()


class HomeInUse(RuntimeError):
    """Another running system holds this home: two would share one Redis data directory and its files."""


class RedisUnreachable(RuntimeError):
    """The Redis given by OMNI_REDIS_URL does not answer (nothing is started then)."""


@dataclass
class EmbeddedSystem:
    """Owns the processes it started; ``stop()`` ends them in reverse order."""

    settings: Settings
    home: Path
    api_port: int = 8000
    flower_port: int = 5555
    flower_user: str = "admin"
    flower_password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    redis_url: str | None = None
    """An existing Redis to use; None starts a private one (with AOF) under home."""
    redis_durability: str = "auto"
    """How the private Redis keeps a 202 (docs/reliability.md): 'always' (AOF fsynced before every
    reply), 'waitaof' (AOF fsynced every second, and each submit waits for its own fsync: WAITAOF,
    OMNI_REDIS_WAIT_AOF; needs Redis >= 7.2 or Valkey), 'auto' ('waitaof' where such a server is
    installed, else 'always'), or 'everysec' (for benchmarks: up to a second of 202s lost in a crash)."""
    redis_wait_aof: bool = False
    """Set at start: the private Redis is on 'waitaof', so every process gets OMNI_REDIS_WAIT_AOF=true."""
    redis_replicas: int = 0
    """Replicas of the private Redis, with 3 Sentinels (omni_jobs.local.ha): every process is given the
    Sentinels' URL and follows the primary through a failover; submits wait for a replica
    (OMNI_REDIS_WAIT_REPLICAS=1) unless the environment says otherwise. 0: one Redis, no Sentinels."""
    redis_ha: RedisHA | None = None
    """Set at start when ``redis_replicas`` > 0."""
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_queues: dict[str, str] = field(default_factory=lambda: dict(WORKER_QUEUES))
    with_flower: bool = True
    engine_workers: int = 1
    """Worker processes per stage queue (ar, dit), each with its own slice of the cores
    (omni_jobs.engines.cpu_layout): on a CPU host, one per core is the fastest layout; 1 runs one worker
    per queue on every core (one model copy, and a single job runs on all of them)."""
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Worker node name -> the port its Prometheus metrics are served on (the API serves /metrics)."""
    webhook_secret: str = field(default_factory=generate_secret, repr=False)
    """Signs webhooks unless OMNI_WEBHOOK_SECRET is set; written to ``home/webhook-secret`` (mode 0600)."""
    processes: list[RunningService] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)
    """The demo's API key (tenant ``demo_tenant``), made at start when auth is on; in ``home/api-key`` (0600)."""
    demo_tenant: str = "demo"
    _home_lock: int | None = field(default=None, repr=False)
    """The open lock file while this system holds its home (the kernel drops it if the process dies)."""

    @property
    def auth_enabled(self) -> bool:
        """Auth is on unless OMNI_AUTH_ENABLED says false, explicitly (the API then logs a warning)."""
        value = self.child_env().get("OMNI_AUTH_ENABLED", "true").strip().lower()
        return value not in ("0", "false", "no", "off")

    @property
    def api_key_file(self) -> Path:
        return self.home / "api-key"

    def create_api_key(self, tenant: str, name: str = "") -> str:
        """A new API key for ``tenant`` in this system's Redis (tests make one per tenant)."""
        from omni_jobs.accept.auth import ApiKeys

        assert self.redis_url, "start() first"
        client = redis_client(self.redis_url)
        try:
            return ApiKeys(client).create(tenant, name)[0]
        finally:
            client.close()

    def _make_demo_key(self, say: Callable[[str], None]) -> None:
        if not self.auth_enabled:
            say("WARNING: authentication is off (OMNI_AUTH_ENABLED=false): anyone reaching the API sees every job")
            return
        if self.api_key is None:
            self.api_key = self.create_api_key(self.demo_tenant, "omni-jobs up")
        _write_private(self.api_key_file, self.api_key + "\n")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def flower_url(self) -> str:
        return f"http://127.0.0.1:{self.flower_port}"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "OMNI_REDIS_URL": self.redis_url or "",
            "OMNI_MODELS_DIR": str(self.settings.models_dir.resolve()),
            "OMNI_ARTIFACTS_DIR": str(self.settings.artifacts_dir.resolve()),
            "OMNI_PUBLIC_URL": self.api_url,
            "PYTHONUNBUFFERED": "1",
        })
        if self.redis_wait_aof:
            env["OMNI_REDIS_WAIT_AOF"] = "true"
        if self.redis_ha is not None:
            env.setdefault("OMNI_REDIS_WAIT_REPLICAS", "1")
        env.setdefault("OMNI_WEBHOOK_SECRET", self.webhook_secret)
        if self.with_flower:
            env.setdefault("OMNI_UI_FLOWER_URL", self.flower_url)  # the web console's header links to it
            # Flower would turn the workers' task events on within 5 s; on from the start, it sees the first job too.
            env.setdefault("OMNI_WORKER_TASK_EVENTS", "true")
        env.update(self.extra_env)
        return env

    @property
    def cli_env_file(self) -> Path:
        """Shell exports that point the ``omni-jobs`` commands of another shell at this system (0600)."""
        return self.home / "env"

    def cli_env(self) -> dict[str, str]:
        """The OMNI_ settings this system's processes run with, and its API's URL and demo key.

        `omni-jobs doctor` and `keys` read Redis and the artifact store from these, `list` and
        `submit` the API: without them a second shell would check the default Redis, not this one."""
        env = {k: v for k, v in self.child_env().items() if k.startswith("OMNI_")}
        env["OMNI_API_URL"] = self.api_url
        if self.api_key:
            env["OMNI_API_KEY"] = self.api_key
        return env

    def write_cli_env(self) -> Path:
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(self.cli_env().items()))
        _write_private(self.cli_env_file, exports)  # it holds the demo key and the webhook secret
        return self.cli_env_file

    @property
    def webhook_secret_file(self) -> Path:
        return self.home / "webhook-secret"

    def _keep_webhook_secret(self) -> None:
        """Reuse the secret of an earlier run in this home (receivers keep verifying), else save ours."""
        path = self.webhook_secret_file
        if path.exists() and "OMNI_WEBHOOK_SECRET" not in os.environ:
            self.webhook_secret = path.read_text().strip() or self.webhook_secret
        _write_private(path, self.child_env().get("OMNI_WEBHOOK_SECRET", "") + "\n")

    def claim_home(self) -> None:
        """Hold ``home`` for this system until stop(), so that no second one starts its Redis on the same data."""
        self.home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.home / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise HomeInUse(f"another omni-jobs system (pid {holder}) is running in {self.home}: stop it, "
                            "or start this one with another --home") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._home_lock = fd

    def start(self, say: Callable[[str], None] = print) -> None:
        self.claim_home()
        self.logs.mkdir(parents=True, exist_ok=True)
        self._keep_webhook_secret()
        if self.redis_url:
            say(f"using Redis at {self.redis_url}")
            _check_reachable(self.redis_url)
        elif self.redis_replicas > 0:
            self._start_redis_ha(say)
        else:
            # A job answered 202 is on disk either way (docs/reliability.md).
            service, mode = start_job_redis(self.home / "redis", self.redis_durability)
            self.processes.append(service)
            self.redis_url = service.url
            self.redis_wait_aof = mode == "waitaof"
            say(f"started Redis at {self.redis_url} (data in {self.home / 'redis'}; {DURABILITY_SAID[mode]})")
        self._make_demo_key(say)
        say("building the tiny local models (once) ...")
        for name in TINY_MODELS:
            ensure_tiny_model(name, self.settings.models_dir)
        if not _port_free(self.api_port):
            self.api_port = free_port()
        if not _port_free(self.flower_port):
            self.flower_port = free_port()
        self._spawn("api", [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1",
                            "--port", str(self.api_port)], self.api_port, _http_ok(f"{self.api_url}/healthz"))
        for queue in self.worker_queues:
            for node, env in self.worker_nodes(queue):
                self.start_worker(queue, name=node, env=env)
        if self.with_flower:
            self._spawn("flower", [sys.executable, "-m", "celery", "-A", "workers.app:app", "flower",
                               "--address=127.0.0.1", f"--port={self.flower_port}",
                               f"--basic-auth={self.flower_user}:{self.flower_password}"],
                        self.flower_port, _http_ok(f"{self.flower_url}/healthcheck"))
        say("waiting for the workers to load their engines ...")
        self.wait_for_workers(set(self.worker_queues))
        self.write_cli_env()

    def _start_redis_ha(self, say: Callable[[str], None]) -> None:
        """A primary, ``redis_replicas`` replicas and 3 Sentinels, each durable as ``redis_durability`` asks."""
        mode, binary = redis_durability(self.redis_durability)
        self.redis_ha = start_redis_ha(self.home / "redis", replicas=self.redis_replicas, binary=binary,
                                       appendfsync="always" if mode == "always" else "everysec",
                                       waitaof=mode == "waitaof")
        self.processes.extend(self.redis_ha.processes)
        self.redis_url = self.redis_ha.url
        self.redis_wait_aof = mode == "waitaof"
        ports = ", ".join(str(n.port) for n in self.redis_ha.nodes)
        say(f"started Redis with {self.redis_replicas} replica(s) (ports {ports}; {DURABILITY_SAID[mode]}) and "
            f"3 Sentinels: {self.redis_url} (data in {self.home / 'redis'})")

    def start_worker(self, queue: str, *, name: str | None = None, env: dict[str, str] | None = None,
                     pool: str | None = None) -> RunningService:
        """One Celery worker process on one queue (tests start extra ones, or restart killed ones)."""
        node = name or queue
        pool = pool or self.worker_queues.get(queue, "solo")
        argv = [sys.executable, "-m", "celery", "-A", "workers.app:app", "worker", "-Q", queue, "-P", pool,
                "-c", str(self.concurrency(queue)), "-n", f"{node}@%h", "--loglevel", "INFO"]
        self.metrics_ports[node] = free_port()
        return self._spawn(f"worker-{node}", argv, 0, lambda: True, env=self.worker_env(
            {"OMNI_METRICS_PORT": str(self.metrics_ports[node]), **(env or {})}))

    def worker_nodes(self, queue: str) -> list[tuple[str, dict[str, str]]]:
        """Node name and environment of each worker process ``queue`` gets: one, or for a stage queue
        ``engine_workers`` of them (``ar``, ``ar-2``, ...), each on its own cores."""
        if queue not in STAGE_QUEUES or self.engine_workers == 1:
            return [(queue, {})]
        cpus = host_cpus()
        return [(queue if i == 0 else f"{queue}-{i + 1}", {"OMNI_ENGINE_CPUS": engine_slice(i, self.engine_workers, cpus)})
                for i in range(self.engine_workers)]

    def worker_env(self, overrides: dict[str, str]) -> dict[str, str]:
        """A worker's environment: this system's, then ``overrides``, with the engines' malloc preloaded
        (tcmalloc where OMNI_ENGINE_MALLOC and the host allow it: omni_jobs.engines.allocator)."""
        return dict(engine_process_env({**self.child_env(), **overrides}))

    def supervise(self, say: Callable[[str], None] = print) -> list[str]:
        """Start again every process of this system that exited (as compose's restart policy does):
        a worker killed or out of memory, the API, and the Redis this system started (from its AOF).
        Returns the names restarted."""
        restarted: list[str] = []
        for proc in self.processes:
            if proc.running:
                continue
            say(f"{proc.name} exited; restarting it (see {proc.log_path})")
            try:
                proc.start()
            except Exception as exc:  # noqa: BLE001 - keep supervising the others; try again next time
                say(f"{proc.name} did not start: {exc}")
                continue
            restarted.append(proc.name)
        return restarted

    def concurrency(self, queue: str) -> int:
        """Tasks one worker of ``queue`` runs at once (stage queues: OMNI_STAGE_MAX_IN_FLIGHT, as the
        workers will read it, so the pool and the batcher's in-flight limit agree)."""
        if queue in STAGE_QUEUES and self.worker_queues.get(queue) == "threads":
            value = self.child_env().get("OMNI_STAGE_MAX_IN_FLIGHT")
            return int(value) if value else self.settings.stage_max_in_flight
        return WORKER_CONCURRENCY.get(queue, 1)

    def _spawn(self, name: str, argv: list[str], port: int, ready: Callable[[], bool],
               env: dict[str, str] | None = None, cwd: Path | None = None) -> RunningService:
        """Start one process of this system (``cwd``: where it runs, this process's by default)."""
        service = RunningService(name, argv, port, f"{name}:{port}", ready, log_path=self.logs / f"{name}.log",
                                 start_timeout_s=120, cwd=cwd or Path.cwd(), env={**self.child_env(), **(env or {})})
        service.start()
        self.processes.append(service)
        return service

    def wait_for_workers(self, queues: set[str], timeout_s: float = 300, expected: Mapping[str, int] | None = None
                         ) -> None:
        """Until every queue has its workers live: ``expected[queue]`` of them, else as many as this system
        starts for it (one for a queue it does not start: another's twins, say)."""
        assert self.redis_url, "start() first"
        client = redis_client(self.redis_url)
        deadline = time.monotonic() + timeout_s
        missing = sorted(queues)
        try:
            while time.monotonic() < deadline:
                live = live_workers(client)
                missing = [q for q in sorted(queues)
                           if len(live.get(q, [])) < (expected or {}).get(q, self._workers_expected(q))]
                if not missing:
                    return
                for proc in self.processes:
                    if not proc.running:
                        raise RuntimeError(f"{proc.name} exited; see {proc.log_path}")
                time.sleep(0.5)
        finally:
            client.close()
        raise TimeoutError(f"no worker came up for queues {missing}; see the logs in {self.logs}")

    def _workers_expected(self, queue: str) -> int:
        return len(self.worker_nodes(queue)) if queue in self.worker_queues else 1

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop(timeout_s=20)
        self.processes.clear()
        if self._home_lock is not None:  # not when start() found the home another system's
            self.cli_env_file.unlink(missing_ok=True)  # its ports and Redis are gone
            os.close(self._home_lock)
            self._home_lock = None
