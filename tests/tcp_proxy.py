"""A TCP proxy on loopback, for tests that put a fault between a process and a server it talks to.

``TcpProxy(upstream_port)`` listens on a free loopback port (``port``, ``url``); every connection it
accepts gets its own connection to the upstream port, and two threads pump the bytes, requests
(client -> upstream) and replies (upstream -> client). What it does to them is a subclass's:
- ``on_request`` / ``on_reply`` see each chunk before it is passed on: they may block (hold it), or
  answer False to drop it and close that connection;
- ``replies`` (or ``requests``) may replace a whole direction's pump (delay it).

Used as a context manager: ``__enter__`` starts accepting, ``__exit__`` stops (``cut`` also closes
every connection it made). The proxies the tests use: tests/fault/gate_proxy.py (hold an upload in
flight), tests/fault/lag_proxy.py (replication lag), ReplyCutter here (lose a reply).
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

Hook = Callable[[bytes, "Link"], bool]


@dataclass
class Link:
    """One proxied connection: the accepted client socket and its own connection upstream."""

    client: socket.socket
    upstream: socket.socket
    doomed: threading.Event = field(default_factory=threading.Event)
    """Set by a proxy to end this connection at its next reply (see ReplyCutter)."""


def shut(*sockets: socket.socket) -> None:
    """Shut both ways, ignoring a socket already gone: the peer sees its connection end."""
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class TcpProxy:
    name = "tcp-proxy"
    backlog = 64

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._server = socket.create_server(("127.0.0.1", 0), backlog=self.backlog)
        self.port: int = self._server.getsockname()[1]
        self._stopped = threading.Event()
        self._links: list[Link] = []
        self._links_lock = threading.Lock()  # a link accepted while cut() runs is cut too, not left open

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # --- what passes (subclasses) ---

    def on_request(self, data: bytes, link: Link) -> bool:
        """A chunk on its way upstream; False drops it and closes the connection."""
        return True

    def on_reply(self, data: bytes, link: Link) -> bool:
        """A chunk on its way back to the client; False drops it and closes the connection."""
        return True

    def requests(self, link: Link) -> None:
        self.pump(link.client, link.upstream, link, self.on_request)

    def replies(self, link: Link) -> None:
        self.pump(link.upstream, link.client, link, self.on_reply)

    # --- the machinery ---

    def pump(self, source: socket.socket, sink: socket.socket, link: Link, hook: Hook,
             close_at_end: bool = True) -> None:
        """Bytes one way until either side ends or the proxy is cut (then both sockets are shut, unless
        ``close_at_end`` is False), or until ``hook`` answers False."""
        try:
            while True:
                data = source.recv(65536)
                if not data or not hook(data, link):
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            if close_at_end:
                shut(source, sink)

    def _serve(self) -> None:
        while not self.stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:  # the server is down: the client sees its connection closed, as it would
                client.close()
                continue
            link = Link(client, upstream)
            with self._links_lock:
                if self.stopped:
                    self._close(link)
                    return
                self._links.append(link)
            threading.Thread(target=self.requests, args=(link,), name=f"{self.name}-requests", daemon=True).start()
            threading.Thread(target=self.replies, args=(link,), name=f"{self.name}-replies", daemon=True).start()

    def cut(self) -> None:
        """Stop accepting, and close every connection made (their peers see them end at once)."""
        with self._links_lock:
            self._stopped.set()
            for link in self._links:
                self._close(link)
        shut(self._server)
        self._server.close()

    @staticmethod
    def _close(link: Link) -> None:
        shut(link.client, link.upstream)
        link.client.close()
        link.upstream.close()

    def __enter__(self) -> Self:
        threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopped.set()
        self._server.close()


class ReplyCutter(TcpProxy):
    """Once armed, lets the next request matching a pattern reach the server, then closes that connection
    instead of passing the server's reply back: the write applied, its answer lost."""

    name = "reply-cutter"

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self._pattern: re.Pattern[bytes] | None = None
        self.cut_reply = threading.Event()
        """Set once a reply was dropped."""
        self._lock = threading.Lock()

    def arm(self, pattern: bytes) -> None:
        with self._lock:
            self._pattern = re.compile(pattern)
            self.cut_reply.clear()

    def on_request(self, data: bytes, link: Link) -> bool:
        with self._lock:  # a request that matches dooms its connection: its reply is dropped
            if self._pattern is not None and self._pattern.search(data) is not None:
                self._pattern = None
                link.doomed.set()
        return True

    def on_reply(self, data: bytes, link: Link) -> bool:
        if link.doomed.is_set():
            self.cut_reply.set()
            return False
        return True
