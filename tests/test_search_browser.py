"""The search page in a real browser: headless Chromium types a query into the page `vse serve` serves on
localhost and must see pictures whose captions match. Needs Debian's chromium and PyPI's playwright.

The screenshot is an artefact: it goes to $VSE_ARTIFACTS/search_page.png when that variable names a folder
(CI uploads it; docs/figures/search_page.png was made this way), else to the test's tmp folder."""

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from vsekit.search.index import build_index

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _require_browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; no `playwright install` needed)")
    pytest.importorskip("uvicorn")
    pytest.importorskip("faiss")
    pytest.importorskip("efficientnet_lite_pytorch")


@contextlib.contextmanager
def serving(index_dir: Path):
    """`vse serve INDEX` in a thread on a free port; yields its base URL (no trailing slash), stops it after."""
    import uvicorn

    from vsekit.search.server import create_app

    server = uvicorn.Server(
        uvicorn.Config(create_app(index_dir), host="127.0.0.1", port=0, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                pytest.fail("the search server did not start within 30 s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, request):
    _require_browser()
    data, run = request.getfixturevalue("shapes_model")  # after the browser check: no training when it skips
    out = tmp_path_factory.mktemp("browser") / "idx"
    build_index(run, f"{data}:test", out, progress=False, log=lambda *_: None)
    with serving(out) as url:
        yield url


@pytest.mark.slow
def test_page_shows_matching_pictures(server_url, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 700})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server_url + "/")
            page.wait_for_function(
                "() => document.getElementById('info').textContent.includes('24 pictures')"
            )
            # an empty query is refused on the page, with a message
            page.fill("#q", "   ")
            page.press("#q", "Enter")
            assert "type a few words" in page.text_content("#status")
            page.fill("#q", "a red circle")
            page.select_option("#k", "5")
            page.click("button[type=submit]")
            page.wait_for_selector("#results li.result")
            page.wait_for_function(
                "() => [...document.querySelectorAll('#results img')].every(i => i.complete && i.naturalWidth > 0)"
            )
            captions = page.locator("#results .caption").all_text_contents()
            assert len(captions) == 5
            assert captions[:2] == ["a red circle", "a red circle"], captions
            assert "5 pictures in" in page.text_content("#status")
            assert page.url.endswith("?q=a+red+circle&k=5")
            shot = Path(os.environ.get("VSE_ARTIFACTS") or tmp_path) / "search_page.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            assert not errors, errors
        finally:
            browser.close()
