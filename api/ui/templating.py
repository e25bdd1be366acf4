"""Jinja2 templates of the console (from the installed package), their filters, and the page headers."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import ChainableUndefined, Environment, PackageLoader, Undefined, select_autoescape

from api.ui import session

FLOWER_URL_ENV = "OMNI_UI_FLOWER_URL"
"""Where the header's Flower link points (e.g. http://flower.internal:5555); no link when unset."""

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' data: blob:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
       "base-uri 'none'")
"""Pages run only the console's own script and style; images and media come from its own routes."""

SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",  # pages show a tenant's jobs: never kept by a shared cache
}

STATUSES = ("queued", "running", "succeeded", "failed", "canceled")


def flower_url() -> str | None:
    value = os.environ.get(FLOWER_URL_ENV, "").strip()
    return value if value.startswith(("http://", "https://", "/")) else None


def _missing(value: object) -> bool:
    return value is None or isinstance(value, Undefined)


def _timestamp(value: Any) -> str:
    if _missing(value):
        return ""
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(value: Any) -> str:
    if _missing(value):
        return ""
    return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _seconds(value: Any) -> str:
    """0.042 -> '42 ms', 3.25 -> '3.25 s', 125 -> '2 min 5 s'."""
    if _missing(value):
        return "–"
    if value < 0:
        value = 0.0
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.2f} s"
    minutes, seconds = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _bytes(value: Any) -> str:
    if _missing(value):
        return ""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def _ago(value: Any) -> str:
    if _missing(value):
        return ""
    delta = max(0.0, time.time() - value)
    if delta < 60:
        return f"{delta:.0f} s ago"
    if delta < 3600:
        return f"{delta // 60:.0f} min ago"
    if delta < 86400:
        return f"{delta // 3600:.0f} h ago"
    return f"{delta // 86400:.0f} d ago"


def _pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False, default=str)


env = Environment(
    loader=PackageLoader("api.ui", "templates"),
    autoescape=select_autoescape(["html", "svg"], default_for_string=True, default=True),
    # The job dict is the public shape, where optional keys may be absent and fields may be added:
    # a missing key reads as empty rather than failing the page.
    undefined=ChainableUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
env.filters.update(timestamp=_timestamp, iso=_iso, seconds=_seconds, bytes=_bytes, ago=_ago,
                   pretty_json=_pretty_json)
env.globals.update(statuses=STATUSES)


def render_fragment(name: str, **context: Any) -> str:
    return env.get_template(name).render(**context)


def render(request: Request, name: str, *, status_code: int = 200, viewer: session.Viewer | None = None,
           **context: Any) -> HTMLResponse:
    """A whole page: the template with the header's context, the CSRF token and the security headers."""
    token = session.csrf_token(request)
    html = env.get_template(name).render(
        viewer=viewer, csrf_token=token, csrf_field=session.CSRF_FIELD, flower_url=flower_url(),
        path=request.url.path, **context)
    response = HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)
    session.persist_csrf_token(request, response)
    return response
