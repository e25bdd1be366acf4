"""How many long requests (SSE streams, the console's live pages, ``Prefer: wait``, the OpenAI routes, which
answer when their job ends) an API process holds.

Each one holds a Redis connection while it blocks on its job's event stream (omni_jobs.jobs.watch):
without a bound, one key opening thousands of streams reached Redis's ``maxclients``, and the
workers, on the same Redis, could no longer connect. So a tenant holds at most
OMNI_MAX_STREAMS_PER_TENANT of them at once (429), the process at most OMNI_MAX_STREAMS (503), and
their connections come from a pool of that size of their own (``JobWatcher.from_url``). Counted in
the process (each API replica has its own pool), on its event loop.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterator
from typing import Self, TypeVar

from fastapi import HTTPException, status

RETRY_AFTER_S = 5
T = TypeVar("T")


class Slot:
    """One long request's place; ``release`` is idempotent. As a context manager it is released at the end of
    the block unless a streaming body took it over (``guard``)."""

    def __init__(self, slots: StreamSlots, tenant: str) -> None:
        self._slots = slots
        self.tenant = tenant
        self._held = True
        self._guarded = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        if not self._guarded:
            self.release()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._release(self.tenant)

    def guard(self, body: AsyncIterator[T]) -> AsyncIterator[T]:
        """``body`` (a streaming response's), giving the place back when it ends, fails or is dropped
        (a client that disconnects before the body starts leaves it never iterated)."""

        self._guarded = True

        async def guarded() -> AsyncIterator[T]:
            try:
                async for chunk in body:
                    yield chunk
            finally:
                self.release()

        stream = guarded()
        weakref.finalize(stream, self.release)
        return stream


class StreamSlots:
    def __init__(self, *, per_tenant: int, total: int) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._held: dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()

    def held(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._count if tenant is None else self._held.get(tenant, 0)

    def try_take(self, tenant: str) -> Slot | None:
        """A place for ``tenant``, or None when it (or the process) has none left."""
        with self._lock:
            if self._held.get(tenant, 0) >= self.per_tenant or self._count >= self.total:
                return None
            self._held[tenant] = self._held.get(tenant, 0) + 1
            self._count += 1
        return Slot(self, tenant)

    def take(self, tenant: str) -> Slot:
        """A place for ``tenant``; else a 429 (the tenant's) or a 503 (the process's), with Retry-After."""
        slot = self.try_take(tenant)
        if slot is not None:
            return slot
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if self.held(tenant) >= self.per_tenant:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, headers=headers, detail=(
                f"tenant '{tenant}' holds {self.per_tenant} streams or waits open already "
                f"(OMNI_MAX_STREAMS_PER_TENANT); close one, or follow the job by polling GET /v1/jobs/{{id}}"))
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, headers=headers, detail=(
            f"this API process holds {self.total} streams or waits open (OMNI_MAX_STREAMS); retry shortly, "
            "or follow the job by polling GET /v1/jobs/{id}"))

    def _release(self, tenant: str) -> None:
        with self._lock:
            left = self._held.get(tenant, 0) - 1
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)
            self._count = max(0, self._count - 1)
