"""The web console in a real browser: Playwright driving Debian's chromium against the real system.

One system per session, as the e2e suite starts it (tests/e2e/conftest.py): the API under uvicorn,
one Celery worker per queue, Flower, on the session redis-server; artifacts on local disk. One
browser per session; each test signs in with its own browser context (cookies apart).

The browser tests skip, saying why, only when no chromium can be found (scripts/bootstrap installs
Debian's `chromium` when run as root) or Playwright is not installed. Screenshots of every page go
to var/ui-screenshots/ for review.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_jobs.core.settings import Settings
from omni_jobs.local.devservices import RunningService, free_port
from omni_jobs.local.embedded import EmbeddedSystem
from tests.e2e.conftest import BROKEN_MODEL_PIPELINE, WEBHOOK_ENV, models_dir

UI_REDIS_DB = 5  # apart from the integration tests (DB 0) and the e2e system (DB 3)
REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "var" / "ui-screenshots"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-sync", "--disable-quic",
    "--autoplay-policy=no-user-gesture-required",  # the audio test calls play() without a click
]


def find_chromium() -> str | None:
    """OMNI_UI_CHROMIUM, else a chromium on PATH (Debian's package puts it at /usr/bin/chromium)."""
    explicit = os.environ.get("OMNI_UI_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no chromium found (install Debian's `chromium`, as scripts/bootstrap does when root, "
                    "or set OMNI_UI_CHROMIUM to a Chrome/Chromium binary)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[test]')")
    return path


@pytest.fixture(scope="session")
def ui_system(chromium_path: str, tmp_path_factory: pytest.TempPathFactory,
              redis_service: RunningService) -> Iterator[EmbeddedSystem]:
    """The system, started only where a browser can test it (chromium_path skips first otherwise)."""
    home = tmp_path_factory.mktemp("ui-system")
    pipelines = home / "pipelines"
    pipelines.mkdir()
    (pipelines / "broken-model.yaml").write_text(yaml.safe_dump(BROKEN_MODEL_PIPELINE))
    redis_url = f"redis://127.0.0.1:{redis_service.port}/{UI_REDIS_DB}"
    flower_port = free_port()
    settings = Settings(models_dir=models_dir(), artifacts_dir=home / "artifacts", redis_url=redis_url)
    system = EmbeddedSystem(
        settings=settings, home=home, api_port=free_port(), flower_port=flower_port, redis_url=redis_url,
        extra_env={
            "OMNI_PIPELINES_PATH": json.dumps([str(pipelines)]),
            "OMNI_STAGE_MAX_IN_FLIGHT": "1",  # one job at a time per stage: the cancel test's long job runs alone
            "OMNI_UI_FLOWER_URL": f"http://127.0.0.1:{flower_port}",
            **WEBHOOK_ENV,
        },
    )
    try:
        system.start(say=lambda _msg: None)
        yield system
    finally:
        system.stop()


@pytest.fixture(scope="session")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Playwright gives every launch a fresh, empty user-data-dir of its own.
        instance = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_FLAGS, headless=True)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture(scope="session")
def tenant_keys(ui_system: EmbeddedSystem) -> dict[str, str]:
    return {"alpha": ui_system.create_api_key("alpha", "tests/ui"), "beta": ui_system.create_api_key("beta", "tests/ui")}


@pytest.fixture
def new_page(browser: Any, ui_system: EmbeddedSystem) -> Iterator[Callable[..., Any]]:
    """``new_page()`` -> a page in a fresh browser context (its own cookies) on the system's API.

    Any script error or Content-Security-Policy violation in those pages fails the test.
    """
    contexts: list[Any] = []
    problems: list[str] = []

    def console(message: Any) -> None:
        # A 404 page the test asked for on purpose is not a problem; anything else the browser reports is.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            problems.append(f"console: {message.text}")

    def make(**options: Any) -> Any:
        context = browser.new_context(base_url=ui_system.api_url, viewport={"width": 1280, "height": 900},
                                      **options)
        context.set_default_timeout(30_000)
        contexts.append(context)
        page = context.new_page()
        page.on("console", console)
        page.on("pageerror", lambda error: problems.append(f"script error: {error}"))
        return page

    yield make
    for context in contexts:
        context.close()
    assert not problems, problems


@pytest.fixture
def sign_in(new_page: Callable[..., Any], tenant_keys: dict[str, str]) -> Callable[[str], Any]:
    """``sign_in("alpha")`` -> a page signed in as that tenant, on the jobs list."""

    def run(tenant: str) -> Any:
        page = new_page()
        page.goto("/ui/login")
        page.fill("input[name=api_key]", tenant_keys[tenant])
        page.click("button[type=submit]")
        page.wait_for_url("**/ui/jobs")
        return page

    return run


def screenshot(page: Any, name: str) -> Path:
    """Save the whole page under var/ui-screenshots/ (for review; var/ is not committed)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
