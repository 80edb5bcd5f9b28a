"""report.html as a reader first sees it: headless Chromium (make test installs it) at 1280 x 800 opens the report
of a demo-shaped run (the showcase grids at the demo's size, an evaluation with five draws) and finds the
results table and the first showcase grid on the first screen, the configuration folded away."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fixtures.servers import headless_chromium
from PIL import Image
from test_report import synthetic_run

from flowfleet.evaluate.report import write_report

pytestmark = pytest.mark.browser

VIEWPORT = {"width": 1280, "height": 800}


def demo_shaped_run(path):
    """The report test's synthetic run with what the demo adds: showcase grids of its size (884 x 244 pixels) and
    an evaluation judged by the digit classifier over five draws."""
    root = synthetic_run(path)
    rng = np.random.default_rng(0)
    for name in ("monolith", "top2"):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (244, 884), dtype=np.uint8)).save(buf, format="PNG")
        root.write_bytes(buf.getvalue(), "reports", "showcase", f"{name}.png")
    ev = root.read_json("reports", "evaluation.json")
    seeds = [0, 1, 2, 3, 4]
    for i, name in enumerate(ev["runs"]):
        ev["runs"][name].update(cfg=2.0, classifier_fd=40.0 + i, precision=0.9, recall=0.7, prompt_accuracy=0.97)
    ev["draws"] = {
        "seeds": seeds,
        "floor": {"classifier_fd": [25.0] * 5, "precision": [0.9] * 5, "recall": [0.8] * 5},
        "runs": {
            name: {
                "classifier_fd": [40.0 + i + s for s in seeds],
                "prompt_accuracy": [0.97] * 5,
                "precision": [0.9] * 5,
                "recall": [0.7] * 5,
            }
            for i, name in enumerate(ev["runs"])
        },
    }
    root.write_json(ev, "reports", "evaluation.json")
    return root


def test_the_first_screen_shows_the_results_and_the_samples(tmp_path):
    root = demo_shaped_run(tmp_path / "run")
    write_report(root.url)
    with headless_chromium() as browser:
        page = browser.new_page(viewport=VIEWPORT)
        page.goto((tmp_path / "run" / "reports" / "report.html").as_uri())
        results = page.locator("#overview table").bounding_box()
        grid = page.locator("#samples img").first.bounding_box()
        config = page.locator("#config pre")
        visible_config = config.is_visible()
        page.screenshot(path=str(tmp_path / "first-screen.png"))
        page.close()
    assert results is not None and grid is not None
    # the whole results table, and at least half of the first showcase grid, within the first 800 pixels
    assert results["y"] + results["height"] <= VIEWPORT["height"], results
    assert grid["y"] + grid["height"] / 2 <= VIEWPORT["height"], grid
    assert grid["width"] >= 800  # shown at its size, not shrunk to a thumbnail
    assert not visible_config  # run.yaml is folded away until asked for
