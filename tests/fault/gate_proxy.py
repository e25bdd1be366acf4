"""A TCP proxy on loopback that can hold a request in flight, to kill a process mid-upload.

The workers reach S3 through it. ``hold(pattern)`` arms it: the next request whose bytes match
(e.g. ``PUT /bucket/jobs/<id>/outputs/``) is held before it reaches S3, ``wait_held`` returns once
one is, and ``release`` lets it (and everything after it) through. Everything else passes as is.
"""

from __future__ import annotations

import re
import socket
import threading
from typing import Self


class GateProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port: int = self._server.getsockname()[1]
        self._pattern: re.Pattern[bytes] | None = None
        self._held = threading.Event()
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.held_request = b""
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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

    def _gate(self, data: bytes) -> None:
        """Block the sending connection if ``data`` starts the armed request."""
        with self._lock:
            pattern = self._pattern
            if pattern is None or not pattern.search(data):
                return
            self._pattern = None  # one request is held; the rest wait behind the closed gate anyway
            self.held_request = data[:200]
            self._held.set()
        self._open.wait()

    def _pump(self, source: socket.socket, sink: socket.socket, gated: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if gated:
                    self._gate(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:  # S3 is down: the client sees its connection closed, as it would
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def __enter__(self) -> Self:
        threading.Thread(target=self._serve, name="gate-proxy", daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopped = True
        self._open.set()
        self._server.close()
