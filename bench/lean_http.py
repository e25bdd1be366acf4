"""The benchmark's job poster: the standard library's HTTP client, one keep-alive connection per thread.

The driver shares the machine's cores with the system it measures, so its own cost per request lands
in the system arm's figures. httpx cost 0.90-0.92 ms of CPU per POST here, ``http.client`` 0.15-0.16
(8 threads posting 64 jobs to the bare stack of bench.submit); a burst of 64 took 64 ms to post with
httpx and 20 with this.
"""

from __future__ import annotations

import http.client
import json
import secrets
import threading
from typing import Any
from urllib.parse import urlsplit


class JobPoster:
    """POSTs JSON bodies to one API from any number of threads; each thread keeps its own connection."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"JobPoster takes a plain http:// URL, got {base_url!r}")
        self._host, self._port, self._timeout_s = url.hostname, url.port or 80, timeout_s
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._local = threading.local()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """(status, response body). Each POST carries its own Idempotency-Key, so the one retry after a
        connection the server closed while idle (uvicorn's keep-alive timeout) cannot make a second job."""
        payload = json.dumps(body).encode()
        headers = {**self._headers, "Idempotency-Key": secrets.token_hex(16)}
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request("POST", path, body=payload, headers=headers)
                response = conn.getresponse()
                return response.status, response.read()
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        return conn
