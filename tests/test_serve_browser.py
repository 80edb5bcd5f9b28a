"""`flowfleet serve` in a real browser: headless Chromium (Debian's, installed by `make test` through
.ci/install-chromium) driven by Playwright opens the page of a tiny fleet served by the CLI, types a
prompt, generates, waits for the images and the routing views, and saves a screenshot; the server has an API
key, which the page asks for at login."""

from __future__ import annotations

import json

import pytest
from fixtures.random_fleet import tiny_run_config, write_random_fleet
from fixtures.servers import headless_chromium, serve_process

from flowfleet.stages.assemble import assemble

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as b:
        yield b


def test_the_page_generates_and_shows_images_routing_and_the_fleet_card(tmp_path, browser):
    run = tmp_path / "run"
    write_random_fleet(str(run), tiny_run_config(3))
    model = assemble(str(run)).out
    key = "page-key"
    with serve_process(model, ["--max-images", "4", "--api-key", key], log=str(tmp_path / "serve.log")) as url:
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(url, wait_until="domcontentloaded")
        # the page asks for the server's API key first (Gradio's login: any user name, the key as password)
        page.locator("input[type=password]").wait_for(timeout=30_000)
        page.locator("input[type=text]").first.fill("someone")
        page.locator("input[type=password]").fill(key)
        page.get_by_role("button", name="Login").click()
        card = page.locator("#fleet-card")
        card.wait_for(timeout=30_000)
        assert "a fleet of 3 experts" in card.inner_text()

        # an empty prompt: a one-line message on the page, no images
        page.locator("#generate").click()
        page.get_by_text("prompt: empty").first.wait_for(timeout=30_000)
        assert page.locator("#images img").count() == 0

        page.locator("#prompt textarea").fill("a handwritten digit seven")
        page.locator("#generate").click()
        page.locator("#routing img").nth(3).wait_for(timeout=60_000)  # 4 images (the slider's maximum here)
        assert page.locator("#images img").count() == 4
        assert page.locator("#routing img").count() == 4
        summary = page.locator("#summary").inner_text()
        assert "4 image(s)" in summary and "Selections: expert" in summary
        shot = tmp_path / "serve.png"
        page.screenshot(path=str(shot), full_page=True)
        fetch = f"fetch('{url}/api/health', {{headers: {{Authorization: 'Bearer {key}'}}}}).then(r => r.text())"
        health = json.loads(page.evaluate(fetch))
        refused = page.evaluate(f"fetch('{url}/api/health').then(r => r.status)")  # the API wants the key too
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    assert health["served"] == 1 and health["bad_request"] == 1 and health["failed"] == 0 and refused == 401
