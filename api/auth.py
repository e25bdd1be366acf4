"""Authentication of /v1 routes: ``Authorization: Bearer <API key>`` -> the caller's tenant.

A missing, malformed, unknown or revoked key answers 401 with ``WWW-Authenticate: Bearer`` and
the same message whichever it was (no oracle for key ids). The tenant is put on
``request.state.tenant`` and returned, so routes scope every job lookup to it. With
``OMNI_AUTH_ENABLED=false`` (the embedded demo, explicitly) every caller is tenant ``default``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, cast

import redis
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import get_context
from omni_jobs.accept.auth import DEFAULT_TENANT, ID_HEX, KEY_PREFIX, ApiKeyInfo, ApiKeys, InvalidApiKey, hash_key
from omni_jobs.core import keys
from omni_jobs.jobs.change import Guard

bearer = HTTPBearer(auto_error=False, description="An API key: `omni-jobs keys create --tenant T` prints one.")

UNAUTHORIZED = "missing or invalid API key: send 'Authorization: Bearer <key>' (create one with omni-jobs keys create)"


class _OneRecord:
    """The one key record already read, for ApiKeys.verify (which then decides exactly as ever)."""

    def __init__(self, raw: dict[Any, Any]) -> None:
        self.raw = raw

    def hgetall(self, _name: str) -> dict[Any, Any]:
        return self.raw


async def verify(request: Request, key: str) -> ApiKeyInfo:
    """ApiKeys.verify with its one Redis read made on the event loop (no thread per request). The
    record is read on every request, not cached: a revoked key is refused from the next request on."""
    key_id = key.strip().removeprefix(KEY_PREFIX)[:ID_HEX]  # what verify looks up once it checked the form
    raw = await get_context(request).aredis.hgetall(keys.api_key(key_id))
    return ApiKeys(cast(redis.Redis, _OneRecord(raw))).verify(key)


async def authenticate(request: Request,
                       credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    """The tenant of the request's API key."""
    ctx = get_context(request)
    if not ctx.runtime.settings.auth_enabled:
        request.state.tenant = DEFAULT_TENANT
        return DEFAULT_TENANT
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
    try:
        info = await verify(request, credentials.credentials)
    except InvalidApiKey:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED,
                            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'}) from None
    request.state.tenant = info.tenant
    request.state.api_key_id = info.id  # its own quotas, if it has any (docs/scaling.md)
    return info.tenant


def api_key_id(request: Request) -> str | None:
    """The id of the API key that authenticated ``request`` (None while auth is off)."""
    return getattr(request.state, "api_key_id", None)


Tenant = Annotated[str, Depends(authenticate)]
"""A route parameter: the caller's tenant (401 before the route runs when there is none)."""

KEY_CACHE_S = 60.0
KEY_CACHE_MAX = 10_000


async def authenticate_submit(request: Request,
                              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    """``authenticate`` for a submit, without a Redis read per request: a key verified in the last
    KEY_CACHE_S seconds is taken from this process's cache (by the SHA-256 of the key), and the
    submit's own atomic write is guarded by the key's record (``key_guards``: not revoked, same
    hash). So revoking a key refuses its next submit at once, as a fresh read would, and the check
    costs no round trip of its own. An Idempotency-Key replay writes nothing: the route checks the
    key afresh then (``recheck``)."""
    ctx = get_context(request)
    if not ctx.runtime.settings.auth_enabled or credentials is None or credentials.scheme.lower() != "bearer":
        return await authenticate(request, credentials)
    digest = hash_key(credentials.credentials.strip())
    hit = ctx.key_cache.get(digest)
    if hit is not None and hit[0] > time.monotonic():
        info = hit[1]
    else:
        await authenticate(request, credentials)
        info = ApiKeyInfo(id=request.state.api_key_id, tenant=request.state.tenant, name="", created_at=0.0,
                          revoked=False)
        if len(ctx.key_cache) >= KEY_CACHE_MAX:
            ctx.key_cache.clear()
        ctx.key_cache[digest] = (time.monotonic() + KEY_CACHE_S, info)
    request.state.tenant = info.tenant
    request.state.api_key_id = info.id
    record = keys.api_key(info.id)
    request.state.key_guards = (Guard(record, "revoked", ("0", None)), Guard(record, "hash", (digest,)))
    return info.tenant


def key_guards(request: Request) -> tuple[Guard, ...]:
    """What the submit's write must find true of the caller's API key (none while auth is off)."""
    return getattr(request.state, "key_guards", ())


async def recheck(request: Request) -> None:
    """Verify the request's key afresh (401 if it was revoked since it was cached)."""
    if key_guards(request):
        await authenticate(request, await bearer(request))


def key_refused() -> HTTPException:
    """The 401 of a submit whose write found the key revoked (a key guard did not hold)."""
    return HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED,
                         headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


SubmitTenant = Annotated[str, Depends(authenticate_submit)]
"""The caller's tenant for a submit (see ``authenticate_submit``)."""
