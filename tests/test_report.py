"""report.html from a synthetic run root: every section present, images embedded, missing parts named."""

from __future__ import annotations

import base64
import io
import json
from html.parser import HTMLParser

import torch
from PIL import Image

from flowfleet.config import RunConfig
from flowfleet.evaluate.report import SECTIONS, write_report
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.presets import preset
from flowfleet.storage import RunRoot


class Page(HTMLParser):
    """Collects section ids, the 'missing' notes per section, images and table cells."""

    def __init__(self):
        super().__init__()
        self.sections: list[str] = []
        self.missing: dict[str, str] = {}
        self.images: dict[str, list[str]] = {}
        self.cells: list[str] = []
        self._in_missing = self._in_cell = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a["id"])
        elif tag == "p" and a.get("class") == "missing":
            self._in_missing = True
        elif tag == "img":
            self.images.setdefault(self.sections[-1] if self.sections else "", []).append(a["src"])
        elif tag == "td":
            self._in_cell = True

    def handle_endtag(self, tag):
        self._in_missing = self._in_missing and tag != "p"
        self._in_cell = self._in_cell and tag != "td"

    def handle_data(self, data):
        if self._in_missing:
            self.missing[self.sections[-1]] = data
        if self._in_cell:
            self.cells.append(data)


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    return page


def png(seed: int, size: int = 8) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return captioned_grid_png(torch.rand(4, 1, size, size, generator=g) * 2 - 1, ["a", "b", "c", "d"], cols=2)


def job(root: RunRoot, folder: str, steps: int, *, torn: bool = False) -> None:
    lines = [
        json.dumps({"step": s, "loss": 1.0 / (s + 1), "lr": 1e-3, "samples_per_s": 100.0, "time": 1000.0 + s})
        for s in range(0, steps + 1, 5)
    ]
    if torn:
        lines.append('{"step": 99, "lo')  # a crash mid-write
    root.write_bytes(("\n".join(lines) + "\n").encode(), folder, "metrics.jsonl")
    root.write_json(
        {
            "job": folder,
            "state": "done",
            "step": steps,
            "total_steps": steps,
            "last_loss": 0.1,
            "host": "box",
            "pid": 1,
            "heartbeat": 0.0,
        },
        folder,
        "status.json",
    )
    root.write_bytes(png(steps), folder, "samples", f"step-{steps:07d}.png")


def synthetic_run(path) -> RunRoot:
    root = RunRoot(str(path))
    preset("mnist-tiny", name="synthetic").save(root)
    root.write_json({"count": 384, "complete": True}, "data", "manifest.json")
    root.write_json(
        {
            "k": 3,
            "sizes": [100, 150, 134],
            "nmi": 0.61,
            "label_mix": [{"1": 80, "7": 20}, {"0": 150}, {"3": 70, "8": 64}],
        },
        "clusters",
        "report.json",
    )
    for k in range(3):
        root.write_bytes(png(k), "clusters", f"preview-{k}.png")
        job(root, f"experts/{k}", 30, torn=k == 1)
    job(root, "router", 30)
    job(root, "monolith", 90)
    root.write_json(
        {
            "t_buckets": [[i / 10, (i + 1) / 10] for i in range(10)],
            "accuracy": [0.9 - 0.05 * i for i in range(10)],
            "chance": 0.39,
            "items": 256,
        },
        "router",
        "report.json",
    )
    runs = {}
    for name in ("monolith", "top1", "top2", "full"):
        root.write_bytes(png(len(name)), "reports", "samples", f"{name}.png")
        heat = None
        if name != "monolith":
            root.write_bytes(png(7), "reports", "samples", f"{name}.routing.png")
            heat = f"samples/{name}.routing.png"
        runs[name] = {
            "kind": "monolith" if name == "monolith" else "fleet",
            "grid": f"samples/{name}.png",
            "heatmap": heat,
            "prompts": [f"a handwritten digit {d}" for d in range(4)],
        }
    evaluation = {
        "model": str(path / "model"),
        "reference": str(path),
        "n": 64,
        "seed": 0,
        "sampling": {"steps": 6, "guidance_scale": 2.0},
        "fid": {
            "extractor": "default_1-75",
            "resize": 75,
            "standard_input": False,
            "reference_images": 128,
            "generated_images": 64,
            "scores": {"monolith": 81.5, "top1": 90.25, "top2": 77.75, "full": 120.0},
        },
        "runs": runs,
        "adherence": None,
        "diagnostics": {
            "router_accuracy": {"t_buckets": [[0, 0.5], [0.5, 1]], "accuracy": [0.8, 0.4], "chance": 0.39, "items": 64},
            "alignment": {
                "top1": {
                    "dominant_distance": 0.4,
                    "other_distance": 0.7,
                    "assigned_is_dominant": 0.8,
                    "chance": 0.4,
                    "n": 64,
                }
            },
            "disagreement": {"top2": {"t": [1.0, 0.5, 0.0], "spread": [0.1, 0.3, 0.2]}},
            "usage": {"top1": [0.2, 0.5, 0.3], "full": [0.33, 0.33, 0.34]},
        },
        "timings": {"reference_s": 12.0, "total_s": 60.0},
    }
    root.write_json(evaluation, "reports", "evaluation.json")
    root.write_json({"prepare": 10.0, "cluster": 2.0, "train-all": 100.0}, "reports", "timings.json")
    return root


def decode_png(uri: str) -> Image.Image:
    assert uri.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))


def test_report_has_every_section_with_embedded_images(tmp_path):
    root = synthetic_run(tmp_path / "run")
    url = write_report(root.url)
    html = (tmp_path / "run" / "reports" / "report.html").read_text()
    assert url.endswith("reports/report.html")
    page = parse(html)
    assert page.sections == list(SECTIONS)
    # Only adherence is "not applicable" (mnist); nothing else reports missing inputs.
    assert page.missing == {}, page.missing
    assert "Not applicable" in html
    for section, count in {"clusters": 3, "samples": 4, "routing": 3, "fid": 1, "diagnostics": 3}.items():
        assert len(page.images.get(section, [])) == count, (section, len(page.images.get(section, [])))
    # training: the loss plot, the router's accuracy plot, and each job's last sample grid
    assert len(page.images["training"]) == 2 + 5
    for uris in page.images.values():
        for uri in uris:
            assert decode_png(uri).size[0] > 0
    # The FID table carries the numbers of evaluation.json; the non-standard input size is flagged.
    for value in ("81.50", "90.25", "77.75", "120.00"):
        assert value in page.cells
    assert "Non-standard Inception input size" in html
    assert "a handwritten digit 3" in html and "name: synthetic" in html
    # The torn metrics line is skipped, not fatal; the plots are also written beside the page.
    assert sorted(root.ls("reports", "plots")) == [
        "disagreement.png",
        "fid.png",
        "loss_curves.png",
        "router_accuracy.png",
        "router_training_accuracy.png",
        "usage.png",
    ]
    # the job table shows wall times from metrics.jsonl: 90 s for the monolith
    assert "90" in page.cells


def test_report_of_a_fresh_run_names_what_to_run(tmp_path):
    root = RunRoot(str(tmp_path / "run"))
    preset("mnist-tiny").save(root)
    write_report(root.url)
    page = parse((tmp_path / "run" / "reports" / "report.html").read_text())
    assert page.sections == list(SECTIONS)
    assert "flowfleet cluster" in page.missing["clusters"]
    assert "flowfleet train-all" in page.missing["training"]
    for sid in ("samples", "routing", "fid", "adherence", "diagnostics"):
        assert "flowfleet evaluate" in page.missing[sid]
    assert "config" not in page.missing


def test_report_escapes_text_from_the_run_root(tmp_path):
    root = synthetic_run(tmp_path / "run")
    ev = root.read_json("reports", "evaluation.json")
    ev["runs"]["top1"]["prompts"] = ["<script>alert(1)</script>"]
    root.write_json(ev, "reports", "evaluation.json")
    write_report(root.url)
    html = (tmp_path / "run" / "reports" / "report.html").read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_sample_grid_moves_the_shared_prompt_words_to_the_title():
    from flowfleet.evaluate.views import strip_common_prefix

    rest, shared = strip_common_prefix(["a handwritten digit seven", "a handwritten digit one"])
    assert (rest, shared) == (["seven", "one"], "a handwritten digit")
    assert strip_common_prefix(["a small red star", "a small"]) == (["small red star", "small"], "a")
    assert strip_common_prefix(["x y", "z y"]) == (["x y", "z y"], "")
    assert strip_common_prefix(["only one caption"]) == (["only one caption"], "")
    png = captioned_grid_png(torch.zeros(3, 3, 8, 8), ["a digit one", "a digit two", "a digit three"], cols=3)
    assert Image.open(io.BytesIO(png)).size[0] == 3 * (64 + 4) + 4  # 8-px cells upscaled to 64


def test_report_says_when_the_experts_split_the_steps_by_size(tmp_path):
    root = synthetic_run(tmp_path / "run")
    write_report(root.url)
    note = "in proportion to their clusters"  # (the page escapes the apostrophe that follows)
    assert note not in (tmp_path / "run" / "reports" / "report.html").read_text()  # mnist-tiny: equal steps
    raw = preset("mnist-tiny", name="synthetic").to_dict()
    raw["train"]["expert_steps"] = "by_size"
    RunConfig.from_dict(raw).save(root)
    write_report(root.url)
    assert f"K x {raw['train']['steps']} steps {note}" in (tmp_path / "run" / "reports" / "report.html").read_text()


def test_the_results_table_of_one_draw(tmp_path):
    """An evaluation without draws (evaluate --repeats 1): each model's distance, its ratios to the floor and to the
    monolith, then the floor, from the one draw."""
    root = synthetic_run(tmp_path / "run")
    ev = root.read_json("reports", "evaluation.json")
    for name, fd in {"monolith": 40.0, "top1": 50.0, "top2": 44.0, "full": 60.0}.items():
        ev["runs"][name].update(cfg=2.0, classifier_fd=fd, prompt_accuracy=0.97, precision=0.9, recall=0.7)
    ev["reference_split"] = {"floor": {"n": 300, "classifier_fd": 20.0, "precision": 0.88, "recall": 0.91}}
    root.write_json(ev, "reports", "evaluation.json")
    from flowfleet.evaluate.report import ReportBuilder

    rows = {row[0]: row[1:] for row in ReportBuilder(root).results_table().rows}
    assert rows["monolith"] == ["2", "40", "2", "", "0.97", "0.9", "0.7"]
    assert rows["top2"] == ["2", "44", "2.2", "1.1", "0.97", "0.9", "0.7"]  # 2.2x the floor, 1.1x the monolith
    assert rows["real images (the floor)"] == ["", "20", "", "", "", "0.88", "0.91"]
    write_report(root.url)  # and it opens the page
    assert parse((tmp_path / "run" / "reports" / "report.html").read_text()).cells[:2] == ["monolith", "2"]
