"""A real HTTP server on loopback that receives webhooks, records them, and fails on purpose.

Each path has a script of answers for the 1st, 2nd, ... attempt of every message (counted per
``webhook-id``); after the script it answers ``default``. Tests read what arrived and when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


@dataclass(frozen=True)
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    answered: int

    @property
    def message_id(self) -> str:
        return self.headers["webhook-id"]


class WebhookReceiver:
    def __init__(self) -> None:
        self.scripts: dict[str, tuple[list[Answer], Answer]] = {}
        self.received: list[Received] = []
        self._attempts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                answer = receiver._answer(self.path, headers.get("webhook-id", ""))
                if answer.delay_s:
                    time.sleep(answer.delay_s)
                with receiver._lock:
                    receiver.received.append(Received(self.path, headers, body, time.time(), answer.status))
                self.send_response(answer.status)
                for key, value in answer.headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _answer(self, path: str, message_id: str) -> Answer:
        with self._lock:
            attempt = self._attempts.get((path, message_id), 0)
            self._attempts[(path, message_id)] = attempt + 1
        script, default = self.scripts.get(path, ([], Answer()))
        return script[attempt] if attempt < len(script) else default

    def script(self, path: str, answers: list[Answer], default: Answer | None = None) -> str:
        """Set the answers for ``path``; returns its URL."""
        self.scripts[path] = (answers, default or Answer())
        return self.url(path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def at(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def wait_until(self, check: Callable[[], bool], timeout_s: float = 30, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what or check}; got "
                             f"{[(r.path, r.headers.get('omni-webhook-event'), r.answered) for r in self.received]}")

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
