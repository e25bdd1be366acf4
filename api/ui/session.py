"""Sign-in for the console: a server-side session named by an HttpOnly cookie, and CSRF tokens for
every form.

- The session cookie (HttpOnly, SameSite=Strict, Path=/ui, Secure over https, also behind a TLS
  proxy that uvicorn trusts: --forwarded-allow-ips) holds a random token naming a session kept in
  Redis (omni_jobs.accept.auth.ConsoleSessions), which records the API key it signed in with. Every request
  checks that key again, so a revoked key signs its sessions out at once; signing out deletes the
  session, so a copied cookie is worth nothing after it. The key itself never goes into a cookie, a
  URL, a page or a log: it was the cookie's value, usable on every /v1 route by whoever copied it.
- CSRF: a random token in its own cookie (also HttpOnly, SameSite=Strict) that each form repeats
  in a hidden field (double submit); a POST whose field does not match, or whose Origin is
  another site, is refused with 403. SameSite=Strict already keeps other sites' requests from
  carrying the cookies; the token and the Origin check hold even where a browser ignores it.
  The token is renewed at sign-in and sign-out.
- With ``OMNI_AUTH_ENABLED=false`` (the local demo only) everyone is tenant ``default`` and there
  is no sign-in, as in the API.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request, Response

from api.deps import ApiContext
from omni_jobs.accept.auth import DEFAULT_TENANT, ApiKeyInfo, ApiKeys, ConsoleSessions, InvalidApiKey

SESSION_COOKIE = "omni_ui_session"
CSRF_COOKIE = "omni_ui_csrf"
CSRF_FIELD = "csrf_token"
COOKIE_PATH = "/ui"
SESSION_MAX_AGE_S = 12 * 3600
"""A signed-in browser stays signed in this long at most (or until it signs out or the key is revoked)."""


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the tenant whose jobs the pages show."""

    tenant: str
    signed_in: bool
    """False only when authentication is off (there is nothing to sign out of)."""
    key_id: str | None = None
    """The API key the session signed in with: its own quotas apply to what the console submits."""


class NotSignedIn(Exception):
    """No valid session: pages redirect to /ui/login, streams and files answer 401."""


class CsrfFailed(Exception):
    """A POST without the form's CSRF token, or from another origin."""


def _sessions(ctx: ApiContext) -> ConsoleSessions:
    return ConsoleSessions(ctx.runtime.redis, ttl_s=SESSION_MAX_AGE_S)


def viewer(request: Request, ctx: ApiContext) -> Viewer:
    """The signed-in tenant of this request; NotSignedIn without a live session whose key is valid."""
    if not ctx.runtime.settings.auth_enabled:
        return Viewer(DEFAULT_TENANT, signed_in=False)
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        raise NotSignedIn()
    try:
        info = _sessions(ctx).check(token)
    except InvalidApiKey:
        raise NotSignedIn() from None
    return Viewer(info.tenant, signed_in=True, key_id=info.id)


def key_of(ctx: ApiContext, key: str) -> ApiKeyInfo | None:
    """The record of an API key typed into the sign-in form, or None if it is not a valid key."""
    try:
        return ApiKeys(ctx.runtime.redis).verify(key)
    except InvalidApiKey:
        return None


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def start_session(request: Request, response: Response, ctx: ApiContext, info: ApiKeyInfo) -> None:
    """A new session for the key ``info`` (a blocking Redis write: call it from a thread)."""
    token = _sessions(ctx).start(info)
    response.set_cookie(SESSION_COOKIE, token, max_age=SESSION_MAX_AGE_S, path=COOKIE_PATH,
                        httponly=True, samesite="strict", secure=_secure(request))
    new_csrf_token(request, response)  # a token planted before sign-in does not survive it


def end_session(request: Request, response: Response, ctx: ApiContext) -> None:
    """Delete the session in Redis, then the cookie (a blocking Redis write: call it from a thread)."""
    token = request.cookies.get(SESSION_COOKIE)
    if token and ctx.runtime.settings.auth_enabled:
        _sessions(ctx).end(token)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict",
                           secure=_secure(request))
    new_csrf_token(request, response)


def new_csrf_token(request: Request, response: Response) -> str:
    token = secrets.token_urlsafe(32)
    request.state.csrf_token = token
    response.set_cookie(CSRF_COOKIE, token, path=COOKIE_PATH, httponly=True, samesite="strict",
                        secure=_secure(request))
    return token


def csrf_token(request: Request) -> str:
    """The token this page's forms carry: the browser's, or a new one (set on the response by ``render``)."""
    token = getattr(request.state, "csrf_token", None) or request.cookies.get(CSRF_COOKIE)
    if not token:
        token = secrets.token_urlsafe(32)
        request.state.csrf_token = token
        request.state.csrf_is_new = True
    else:
        request.state.csrf_token = token
    return str(token)


def persist_csrf_token(request: Request, response: Response) -> None:
    """Set the cookie of a token made while rendering this response."""
    if getattr(request.state, "csrf_is_new", False):
        response.set_cookie(CSRF_COOKIE, request.state.csrf_token, path=COOKIE_PATH, httponly=True,
                            samesite="strict", secure=_secure(request))


def check_csrf(request: Request, submitted: object) -> None:
    """Refuse a form POST whose token is missing or wrong, or that comes from another origin."""
    origin = request.headers.get("origin")
    if origin and origin != "null":
        hosts = {request.headers.get("host", request.url.netloc), request.headers.get("x-forwarded-host")}
        if urlsplit(origin).netloc not in hosts:
            raise CsrfFailed()
    elif origin == "null":
        raise CsrfFailed()
    cookie = request.cookies.get(CSRF_COOKIE, "")
    if not cookie or not isinstance(submitted, str) or not hmac.compare_digest(cookie.encode(), submitted.encode()):
        raise CsrfFailed()


def safe_next(value: str | None) -> str:
    """Where to go after signing in: a console path only (no open redirect), else the jobs list."""
    if value and value.startswith("/ui/") and not value.startswith("//") and "\\" not in value \
            and not urlsplit(value).netloc and not value.startswith("/ui/login"):
        return value
    return "/ui/jobs"
