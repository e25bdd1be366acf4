"""Authentication of /v1 routes: ``Authorization: Bearer <API key>`` -> the caller's tenant.

A missing, malformed, unknown or revoked key answers 401 with ``WWW-Authenticate: Bearer`` and
the same message whichever it was (no oracle for key ids). The tenant is put on
``request.state.tenant`` and returned, so routes scope every job lookup to it. With
``OMNI_AUTH_ENABLED=false`` (the embedded demo, explicitly) every caller is tenant ``default``.
"""

from __future__ import annotations

from typing import Annotated, Any, cast

import redis
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import get_context
from omni_jobs import keys
from omni_jobs.auth import DEFAULT_TENANT, ID_HEX, KEY_PREFIX, ApiKeyInfo, ApiKeys, InvalidApiKey

_bearer = HTTPBearer(auto_error=False, description="An API key: `omni-jobs keys create --tenant T` prints one.")

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
                       credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
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
    request.state.api_key_id = info.id  # its own quotas, if it has any (README "Scheduling")
    return info.tenant


def api_key_id(request: Request) -> str | None:
    """The id of the API key that authenticated ``request`` (None while auth is off)."""
    return getattr(request.state, "api_key_id", None)


Tenant = Annotated[str, Depends(authenticate)]
"""A route parameter: the caller's tenant (401 before the route runs when there is none)."""
