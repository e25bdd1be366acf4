"""/docs and /redoc render in a real browser with every outside request refused (no CDN, no fonts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_jobs.local.embedded import EmbeddedSystem


def _offline_page(new_page: Callable[..., Any], system: EmbeddedSystem) -> tuple[Any, list[str]]:
    page = new_page()
    outside: list[str] = []

    def only_this_api(route: Any) -> None:
        url = route.request.url
        if url.startswith((system.api_url, "data:", "blob:")):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    page.route("**/*", only_this_api)
    return page, outside


def test_swagger_ui_renders_the_api_with_no_outside_request(new_page: Callable[..., Any],
                                                           ui_system: EmbeddedSystem) -> None:
    page, outside = _offline_page(new_page, ui_system)
    page.goto("/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "omni-jobs" in page.inner_text(".swagger-ui .info .title")
    page.wait_for_selector(".opblock-summary-path[data-path='/v1/jobs']")  # the operations, from /openapi.json
    assert outside == []


def test_redoc_renders_the_api_with_no_outside_request(new_page: Callable[..., Any],
                                                       ui_system: EmbeddedSystem) -> None:
    page, outside = _offline_page(new_page, ui_system)
    page.goto("/redoc")
    page.wait_for_selector("h1:has-text('omni-jobs')")
    page.locator("h2", has_text="Submit a job").first.wait_for()
    assert outside == []
