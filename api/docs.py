"""/docs (Swagger UI) and /redoc with their JavaScript and CSS served by this API, not a CDN.

FastAPI's own pages load their assets from jsdelivr, so on a host without internet they are blank.
The assets come from the ``fastapi-offline`` wheel (Swagger UI and ReDoc builds, no other code of it
is used) and are served under /docs/static. ReDoc's build always shows a logo from cdn.redoc.ly in its
sidebar, so its script is served with that one URL pointing at the local favicon instead.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC_PATH = "/docs/static"
REDOC_CDN_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


def install(app: FastAPI) -> None:
    """Serve /docs, /docs/oauth2-redirect and /redoc; the app must be made with docs_url=None, redoc_url=None."""
    assets = files("fastapi_offline") / "static"
    redoc_js = (assets / "redoc.standalone.js").read_bytes().replace(
        REDOC_CDN_LOGO.encode(), f"{STATIC_PATH}/favicon.png".encode())

    @app.get("/docs/redoc.js", include_in_schema=False)
    def redoc_script() -> Response:
        return Response(redoc_js, media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"})

    app.mount(STATIC_PATH, StaticFiles(directory=str(assets)), name="docs-static")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect = "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} - API docs", oauth2_redirect_url=oauth2_redirect,
            swagger_js_url=f"{STATIC_PATH}/swagger-ui-bundle.js", swagger_css_url=f"{STATIC_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC_PATH}/favicon.png")

    @app.get(oauth2_redirect, include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - API reference",
                              redoc_js_url="/docs/redoc.js",
                              redoc_favicon_url=f"{STATIC_PATH}/favicon.png", with_google_fonts=False)
