"""Start Redis and an S3 endpoint (moto) as child processes, for the embedded demo and the tests.

Each service gets a free port (or the one asked for), and ``start_*`` returns only once it
answers, so callers never race a half-started server. ``restart()`` keeps the port, which lets
fault tests stop a service under a running system and bring it back at the same URL.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

REDIS_INSTALL_HINT = "install it with `apt-get install -y redis-server`"
VALKEY_INSTALL_HINT = ("install Valkey with `apt-get install -y valkey-server` (Debian 12: from bookworm-backports; "
                       "scripts/bootstrap does it)")
MOTO_INSTALL_HINT = "install it with `pip install 'moto[server]'`"

_running: set[RunningService] = set()
_running_lock = threading.Lock()


class ServiceError(RuntimeError):
    """A service binary is missing, or the service did not start answering in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RunningService:
    """A child-process service on a fixed port: ``url``, ``port``, ``pid``, ``stop()``, ``restart()``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        url: str,
        ready: Callable[[], bool],
        *,
        log_path: Path,
        start_timeout_s: float,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.port = port
        self.url = url
        self.log_path = log_path
        self._ready = ready
        self._start_timeout_s = start_timeout_s
        self._cwd = cwd
        self._env = dict(env) if env is not None else None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server process id, or None while stopped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RunningService:
        """Start the process and wait until it answers; raises ServiceError with its log otherwise."""
        if self.running:
            return self
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._cwd,
                env=self._env,
            )
        with _running_lock:
            _running.add(self)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise ServiceError(f"{self.name} exited with code {code} on port {self.port}:\n{self._log_tail()}")
            if self._ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServiceError(
            f"{self.name} did not answer on port {self.port} within {self._start_timeout_s:.0f}s:\n{self._log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout_s``) and wait for it to exit."""
        proc, self._proc = self._proc, None
        with _running_lock:
            _running.discard(self)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL the process, as a crash would (no AOF flush, no clean shutdown), and reap it."""
        proc, self._proc = self._proc, None
        with _running_lock:
            _running.discard(self)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def restart(self) -> RunningService:
        """Stop (if running) and start again on the same port and data directory."""
        self.stop()
        return self.start()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<RunningService {self.name} {self.url} pid={self.pid}>"


@atexit.register
def _stop_all() -> None:
    """Do not leave servers behind when the demo or the test session exits."""
    with _running_lock:
        services = list(_running)
    for service in services:
        service.stop(timeout_s=3.0)


def exit_on_sigterm() -> None:
    """Let SIGTERM end this process as Ctrl-C does: through its ``finally`` blocks and atexit, which
    stop the services it started. SIGTERM's default action ends the process at once, so a benchmark
    stopped with ``kill`` left its Redis, API and workers running, orphaned (and taking the CPU from
    the next run). For the main thread of a launcher (the benchmarks); a handler already set is kept.
    Not for a test process: there the SystemExit would end a test, not the session. A SIGKILL still
    orphans the children."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _start_on_free_port(make: Callable[[int], RunningService], port: int | None) -> RunningService:
    """Start on ``port``, or on a free port, retrying if another process grabbed it first."""
    if port is not None:
        return make(port).start()
    last: ServiceError | None = None
    for _ in range(3):
        try:
            return make(free_port()).start()
        except ServiceError as exc:
            last = exc
    assert last is not None
    raise last


# --- Redis ---
def _redis_ping(port: int) -> bool:
    """True once Redis answers PING with PONG (not LOADING, not refused)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _find_binary(name: str) -> str | None:
    """``name`` on PATH, then in /usr/bin and /usr/local/bin."""
    return shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}") if os.access(p, os.X_OK)), None
    )


def find_redis_server() -> str:
    """Path of redis-server (PATH, then /usr/bin, /usr/local/bin); a clear error otherwise."""
    found = _find_binary("redis-server")
    if found is None:
        raise ServiceError(f"redis-server not found: {REDIS_INSTALL_HINT}")
    return found


WAITAOF_SINCE = (7, 2)
"""The first Redis with WAITAOF (Valkey forked from 7.2.4: every Valkey has it)."""

WAITAOF_HZ = 100
"""The timer rate (``hz``) of a server whose submits wait with WAITAOF. Its main thread learns that a
background fsync ended when it next wakes: with every client waiting, at its next timer tick, every
100 ms at Redis's default 10. At 100, ``python -m bench.submit --rows waitaof`` (16 clients) had p99
14-16 ms against 17-58 at 10, at the same rate; a running CPU engine beside it was no slower (x0.99,
7 paired rounds of the DiT small batches, 20k keys with a TTL): docs/decisions/waitaof-hz-100.md."""


def server_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a redis-server or valkey-server binary, from ``--version`` ((0, 0) if unknown)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0)
    found = re.search(r"\bv=(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def find_waitaof_server() -> str | None:
    """A server binary that can WAITAOF (redis-server >= 7.2, else valkey-server), or None."""
    for name in ("redis-server", "valkey-server"):
        binary = _find_binary(name)
        if binary is not None and server_version(binary) >= WAITAOF_SINCE:
            return binary
    return None


def require_waitaof_server() -> str:
    """``find_waitaof_server()``, or a clear error naming what to install."""
    found = find_waitaof_server()
    if found is None:
        raise ServiceError(f"no Redis server with WAITAOF (Redis >= 7.2 or Valkey) is installed: {VALKEY_INSTALL_HINT}")
    return found


def start_redis(
    *, port: int | None = None, data_dir: Path, appendonly: bool = False, appendfsync: str = "always",
    replica_of: int | None = None, start_timeout_s: float = 10.0, binary: str | None = None, waitaof: bool = False
) -> RunningService:
    """A private redis-server on 127.0.0.1 (no RDB snapshots; AOF when ``appendonly``, fsynced per
    ``appendfsync``: 'always' before each reply, so an acknowledged write survives a crash, or
    'everysec'; see docs/reliability.md). ``replica_of``: the port of a primary to replicate.
    ``binary``: the server to run (e.g. ``find_waitaof_server()``); default redis-server. ``waitaof``:
    submits will wait on it with WAITAOF, so it ticks at ``WAITAOF_HZ`` instead of the server's own 10."""
    binary = binary or find_redis_server()
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)

    def make(p: int) -> RunningService:
        argv = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(p),
            "--save", "",
            "--daemonize", "no",
            "--appendonly", "yes" if appendonly else "no",
            "--appendfsync", appendfsync,
            "--dir", str(data_dir),
            "--logfile", "",
        ]  # fmt: skip
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        if waitaof:
            argv += ["--hz", str(WAITAOF_HZ)]
        return RunningService(
            "redis-server",
            argv,
            p,
            f"redis://127.0.0.1:{p}/0",
            lambda: _redis_ping(p),
            log_path=data_dir / f"redis-{p}.log",
            start_timeout_s=start_timeout_s,
            cwd=data_dir,
        )

    return _start_on_free_port(make, port)


# --- S3 (moto) ---
def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except OSError:
        return False


def start_moto_s3(
    *, port: int | None = None, log_dir: Path | None = None, start_timeout_s: float = 30.0
) -> RunningService:
    """An in-memory S3 endpoint (moto_server) on 127.0.0.1; data is lost on stop/restart.

    Its log goes to ``log_dir`` (default: a temporary directory removed when the process exits).
    """
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        raise ServiceError(f"moto_server not found in {sys.executable}: {MOTO_INSTALL_HINT}")
    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix="omni-moto-"))
        atexit.register(shutil.rmtree, log_dir, ignore_errors=True)  # runs after _stop_all (LIFO)
    else:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)

    def make(p: int) -> RunningService:
        url = f"http://127.0.0.1:{p}"
        return RunningService(
            "moto_server",
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(p)],
            p,
            url,
            lambda: _http_answers(url + "/moto-api/"),
            log_path=log_dir / f"moto-{p}.log",
            start_timeout_s=start_timeout_s,
        )

    return _start_on_free_port(make, port)
