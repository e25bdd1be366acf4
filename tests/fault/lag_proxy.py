"""A TCP proxy on loopback that delays one direction, to give a Redis replica a replication lag.

On one machine a replica is never behind: the primary writes a reply and the replication stream in
the same turn of its event loop, and a SIGKILLed process's sent bytes still arrive. A lost machine
(or a network partition) loses what was on its way to the replica. ``LagProxy`` models that: the
replica replicates through it, the primary's bytes reach it ``lag_s`` late, and ``cut()`` drops
whatever is still on its way, as the machine's death would.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from typing import Self


class LagProxy:
    def __init__(self, upstream_port: int, lag_s: float) -> None:
        self.upstream_port = upstream_port
        self.lag_s = lag_s
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(8)
        self.port: int = self._server.getsockname()[1]
        self._cut = threading.Event()
        self._sockets: list[socket.socket] = []

    def _forward(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while not self._cut.is_set():
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass

    def _delayed(self, source: socket.socket, sink: socket.socket) -> None:
        queue: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()

        def send() -> None:
            try:
                while not self._cut.is_set():
                    with ready:
                        while not queue and not self._cut.is_set():
                            ready.wait(0.05)
                        if self._cut.is_set():
                            return
                        due, data = queue[0]
                    if (wait := due - time.monotonic()) > 0:
                        time.sleep(wait)
                    with ready:
                        queue.popleft()
                    if self._cut.is_set():
                        return
                    sink.sendall(data)
            except OSError:
                pass

        threading.Thread(target=send, name="lag-proxy-send", daemon=True).start()
        try:
            while not self._cut.is_set():
                data = source.recv(65536)
                if not data:
                    break
                with ready:
                    queue.append((time.monotonic() + self.lag_s, data))
                    ready.notify()
        except OSError:
            pass

    def _serve(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                return
            self._sockets += [client, upstream]
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._delayed, args=(upstream, client), daemon=True).start()

    def cut(self) -> None:
        """Drop everything on its way and close every connection (the primary's machine is gone)."""
        self._cut.set()
        for s in [*self._sockets, self._server]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __enter__(self) -> Self:
        threading.Thread(target=self._serve, name="lag-proxy", daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self.cut()
