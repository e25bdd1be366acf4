"""A TCP proxy on loopback that can hold a request in flight, to kill a process mid-upload.

The workers reach S3 through it. ``hold(pattern)`` arms it: the next request whose bytes match
(e.g. ``PUT /bucket/jobs/<id>/outputs/``) is held before it reaches S3, ``wait_held`` returns once
one is, and ``release`` lets it (and everything after it) through. Everything else passes as is.
"""

from __future__ import annotations

import re
import threading

from tests.tcp_proxy import Link, TcpProxy


class GateProxy(TcpProxy):
    name = "gate-proxy"

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self._pattern: re.Pattern[bytes] | None = None
        self._held = threading.Event()
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.held_request = b""

    def hold(self, pattern: str) -> None:
        with self._lock:
            self._pattern = re.compile(pattern.encode())
            self._held.clear()
            self._open.clear()

    def wait_held(self, timeout_s: float) -> bool:
        return self._held.wait(timeout_s)

    def release(self) -> None:
        with self._lock:
            self._pattern = None
        self._open.set()

    def on_request(self, data: bytes, link: Link) -> bool:
        """Block the sending connection if ``data`` starts the armed request."""
        with self._lock:
            pattern = self._pattern
            if pattern is None or not pattern.search(data):
                return True
            self._pattern = None  # one request is held; the rest wait behind the closed gate anyway
            self.held_request = data[:200]
            self._held.set()
        self._open.wait()
        return True

    def __exit__(self, *exc: object) -> None:
        self._open.set()
        super().__exit__(*exc)
