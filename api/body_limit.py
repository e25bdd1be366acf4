"""Request body size limit (OMNI_MAX_REQUEST_BYTES): 413 before a large body is read into memory.

A declared ``Content-Length`` above the limit is refused at once; a chunked body is counted as it
is read and refused when it passes the limit, so no route ever holds more than the limit.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body is larger than {self.max_bytes} bytes "
                                     "(OMNI_MAX_REQUEST_BYTES); send less, or upload files smaller"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        seen = 0
        too_large = False
        refused = False

        async def counted_receive() -> Message:
            nonlocal seen, too_large
            if too_large:  # the app asks again: nothing more comes
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True  # the app sees a truncated body; its answer is replaced by the 413
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal refused
            if not too_large:
                await send(message)
            elif not refused and message["type"] == "http.response.start":
                refused = True
                await self._refuse(send)

        await self.app(scope, counted_receive, guarded_send)


def install(app: Any, max_bytes: int) -> None:
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
