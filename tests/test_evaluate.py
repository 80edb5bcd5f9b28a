"""evaluate on a small random fleet (cheap FID features), prompt adherence on drawn shapes, CLI errors."""

from __future__ import annotations

import io
import logging
from dataclasses import replace

import numpy as np
import pytest
import safetensors.torch
import torch
from fixtures.held_out import SmallFeatures, noise_split
from fixtures.tolerances import gamma

from flowfleet.cli import main
from flowfleet.config import RunConfig
from flowfleet.data.sources import draw_shape
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.adherence import ShapeReader, parse_prompt, prompt_adherence
from flowfleet.evaluate.fid import FIDSettings
from flowfleet.evaluate.report import SECTIONS, write_report
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small models on a shared 2-core box


# ------------------------------------------------------------------------------------------------
#                                       Prompt adherence
# ------------------------------------------------------------------------------------------------


def shapes(n: int, size: int, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    items = [draw_shape(seed, i, size) for i in range(n)]
    images = torch.tensor(np.stack([im for im, _, _ in items])).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return images, [c for _, c, _ in items]


def test_parse_prompt():
    assert parse_prompt("a small red star at the top on a black background") == ("red", "star")
    assert parse_prompt("A Large CYAN cross in the centre on a navy background") == ("cyan", "cross")
    assert parse_prompt("a handwritten digit seven") is None


def test_adherence_reads_the_source_drawings_and_rejects_wrong_prompts():
    images, prompts = shapes(60, 32)
    right = prompt_adherence(images, prompts)
    assert right["both"] == 1.0 and right["n"] == 60 and right["unparsed"] == 0
    wrong = prompt_adherence(images, prompts[1:] + prompts[:1])  # every image with its neighbour's prompt
    assert wrong["both"] < 0.2 and wrong["colour"] < 0.35 and wrong["shape"] < 0.35
    mixed = prompt_adherence(images[:4], prompts[:3] + ["a handwritten digit two"])
    assert mixed["n"] == 3 and mixed["unparsed"] == 1
    blank = ShapeReader(16).read(np.full((16, 16, 3), 128, dtype=np.uint8))
    assert blank.colour is None and blank.shape is None
    with pytest.raises(ValueError, match="RGB"):
        prompt_adherence(images[:, :1], prompts)


def test_adherence_at_16_pixels_is_mostly_right():
    images, prompts = shapes(60, 16, seed=1)
    assert prompt_adherence(images, prompts)["both"] >= 0.85


# ------------------------------------------------------------------------------------------------
#                                   evaluate on a random fleet
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A finished-looking run: synthetic data/ and clusters, random experts, router and monolith, assembled."""
    from fixtures.random_fleet import randomize_, write_random_fleet
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import save_model
    from flowfleet.stages.assemble import assemble

    raw = synthetic_config(k=2, size=8, monolith=True).to_dict()
    raw["encoders"]["semantic"] = {"name": "pixels", "image_size": 8}  # 192-d clustering features
    cfg = RunConfig.from_dict(raw)
    path = tmp_path_factory.mktemp("eval") / "run"
    root = RunRoot(str(path))
    write_synthetic_run(root, cfg, per_cluster=16)
    gen = torch.Generator().manual_seed(0)
    root.write_bytes(
        safetensors.torch.save(
            {
                "fine": torch.randn(4, 192, generator=gen),
                "coarse": torch.randn(2, 192, generator=gen),
                "fine_to_coarse": torch.tensor([0, 0, 1, 1]),
            }
        ),
        "clusters",
        "centroids.safetensors",
    )
    write_random_fleet(root.url, cfg)
    save_model(randomize_(DiTExpert.from_dit_config(cfg.expert), seed=7), root, "monolith", "final")
    root.write_json({"job": "monolith", "state": "done", "step": 1, "total_steps": 1}, "monolith", "status.json")
    assemble(root.url)
    return root


def options(**kw):
    from flowfleet.stages.evaluate import EvaluateOptions

    base = dict(
        n=12,
        batch_size=5,
        ref_n=20,
        grid=6,
        diagnostic_n=3,
        device="cpu",
        fid=FIDSettings(batch_size=7),
        strategies=("top1", "top2", "full"),
        monolith=True,
    )
    return EvaluateOptions(**{**base, **kw})


def test_evaluate_writes_fid_per_strategy_diagnostics_and_a_report(fleet, caplog):
    from flowfleet.stages.evaluate import evaluate

    caplog.set_level(logging.INFO, logger="flowfleet")
    result = evaluate(fleet.url_of("model"), fleet.url, options(), extractor=SmallFeatures())
    assert list(result["runs"]) == ["monolith", "top1", "top2", "full"]
    scores = result["fid"]["scores"]
    assert all(np.isfinite(v) and v >= 0 for v in scores.values())
    assert result["fid"]["extractor"] == "custom-SmallFeatures" and result["fid"]["reference_images"] == 20
    assert fleet.read_json("reports", "evaluation.json")["fid"]["scores"] == scores
    for name, run in result["runs"].items():
        assert fleet.exists("reports", run["grid"]) and len(run["prompts"]) == 6
        assert (run["heatmap"] is None) == (name == "monolith")
    # usage: weight shares per expert; top1 puts each sample on one expert, full spreads over both
    usage = result["diagnostics"]["usage"]
    assert set(usage) == {"top1", "top2", "full"}
    for shares in usage.values():
        # w / w.sum() over 2 experts in float32: one rounding in the sum, one in each division
        assert sum(shares) == pytest.approx(1.0, rel=0, abs=gamma(4, torch.float32)) and len(shares) == 2
    align = result["diagnostics"]["alignment"]["top1"]
    assert align["n"] == 12 and 0.0 <= align["assigned_is_dominant"] <= 1.0
    dis = result["diagnostics"]["disagreement"]["full"]
    assert len(dis["t"]) == len(dis["spread"]) == 3 and dis["t"][0] == 1.0  # synthetic_config: 3 steps
    assert all(s > 0 for s in dis["spread"])  # random experts disagree
    acc = result["diagnostics"]["router_accuracy"]
    assert len(acc["accuracy"]) == 10 and acc["items"] == 32
    assert any("FID" in line for line in caplog.messages)
    # top2 of two experts is the full ensemble: evaluated once, recorded under both names
    assert result["runs"]["full"]["same_as"] == "top2" and result["runs"]["top2"]["same_as"] is None
    assert scores["full"] == scores["top2"] and usage["full"] == usage["top2"]
    assert any("full uses the same experts with the same weights as top2" in line for line in caplog.messages)
    write_report(fleet.url)
    assert (
        "full selects the same experts with the same weights as top2"
        in fleet.local_path("reports", "report.html").read_text()
    )

    # Same seed, same prompts and noise: a second evaluation reproduces every FID and reuses the cache;
    # `full` sampled for itself gives what was recorded for it from top2.
    again = evaluate(
        fleet.url_of("model"),
        fleet.url,
        options(strategies=("top1", "full"), monolith=False, diagnostics=False),
        extractor=SmallFeatures(),
    )
    # the same seed, prompts, batches and process: the same images, features and sums, so the same bits
    assert again["fid"]["scores"]["top1"] == scores["top1"]
    assert again["runs"]["full"]["same_as"] is None
    assert again["fid"]["scores"]["full"] == scores["full"]
    assert [n for n in fleet.ls("reports") if n.startswith("fid_ref_")] == [
        "fid_ref_data_custom-SmallFeatures_n20.safetensors"
    ]

    # The report shows the FID table of the last evaluation.
    write_report(fleet.url)
    html = (fleet.local_path("reports", "report.html")).read_text()
    assert all(f'id="{s}"' in html for s in SECTIONS)
    assert f"{again['fid']['scores']['top1']:.2f}" in html


def test_the_monolith_is_opened_as_its_assembled_folder_and_other_folders_report_apart(fleet, caplog):
    """evaluate --monolith opens RUN_ROOT/model-monolith (assembling it when missing or older than
    monolith/final), the same folder a user evaluates directly; a model folder other than model/ writes
    under reports/<folder>/ and leaves reports/evaluation.json alone."""
    from flowfleet.stages.evaluate import evaluate

    fleet.remove("model-monolith", recursive=True)
    fleet.remove("reports", "evaluation.json")
    caplog.set_level(logging.INFO, logger="flowfleet")
    small = dict(n=6, grid=3, diagnostics=False)
    mono = evaluate(fleet.url_of("model"), fleet.url, options(strategies=(), **small), extractor=SmallFeatures())
    assert fleet.exists("model-monolith", "model_index.json")
    assert sum("assembling the monolith" in line for line in caplog.messages) == 1
    assert fleet.read_json("reports", "evaluation.json")["fid"]["scores"] == mono["fid"]["scores"]

    direct = evaluate(
        fleet.url_of("model-monolith"),
        fleet.url,
        options(strategies=("top1",), monolith=False, **small),
        extractor=SmallFeatures(),
    )
    assert direct["fid"]["scores"]["top1"] == mono["fid"]["scores"]["monolith"]  # the same model, samples
    assert direct["runs"]["top1"]["grid"] == "model-monolith/samples/top1.png"
    assert fleet.exists("reports", "model-monolith", "evaluation.json")
    assert fleet.exists("reports", "model-monolith", "samples", "top1.npz")
    assert fleet.read_json("reports", "evaluation.json")["fid"]["scores"] == mono["fid"]["scores"]  # untouched

    # Up to date: used as it is. Retrained (status.json moves on): assembled again.
    evaluate(fleet.url_of("model"), fleet.url, options(strategies=(), **small), extractor=SmallFeatures())
    assert sum("assembling the monolith" in line for line in caplog.messages) == 1
    status = fleet.read_json("monolith", "status.json")
    try:
        fleet.write_json({**status, "step": 2, "total_steps": 2}, "monolith", "status.json")
        evaluate(
            fleet.url_of("model"),
            fleet.url,
            options(strategies=(), **small),
            extractor=SmallFeatures(),
        )
        assert sum("assembling the monolith" in line for line in caplog.messages) == 2
        assert fleet.read_json("model-monolith", "model_index.json")["source"]["monolith"]["step"] == 2
    finally:
        fleet.write_json(status, "monolith", "status.json")


def test_evaluate_refuses_bad_requests_before_sampling(fleet, tmp_path):
    from flowfleet.stages.evaluate import evaluate

    model = fleet.url_of("model")
    with pytest.raises(FlowfleetError, match="unknown strategy 'top9x'"):
        evaluate(model, fleet.url, options(strategies=("top9x",)), extractor=SmallFeatures())
    with pytest.raises(FlowfleetError, match="k=3 exceeds the 2 experts"):
        evaluate(model, fleet.url, options(strategies=("top3",)), extractor=SmallFeatures())
    with pytest.raises(FlowfleetError, match="^ref_n: 999"):
        evaluate(model, fleet.url, options(ref_n=999), extractor=SmallFeatures())
    with pytest.raises(FlowfleetError, match="model_index.json: missing"):
        evaluate(str(tmp_path), fleet.url, options(), extractor=SmallFeatures())
    with pytest.raises(FlowfleetError, match="^n: FID needs at least 2"):
        evaluate(model, fleet.url, options(n=1))
    fleet.write_json({"job": "monolith", "state": "running", "step": 0, "total_steps": 1}, "monolith", "status.json")
    try:
        with pytest.raises(FlowfleetError, match="^monolith: .*not done"):
            evaluate(model, fleet.url, options(), extractor=SmallFeatures())
    finally:
        fleet.write_json({"job": "monolith", "state": "done", "step": 1, "total_steps": 1}, "monolith", "status.json")


def test_cli_evaluate_and_report_errors_are_one_line(fleet, tmp_path, capsys):
    assert main(["evaluate", fleet.url_of("model"), "--reference", fleet.url, "--fid-resize", "40"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["flowfleet evaluate: error: fid resize: 40 outside 75..299"]
    assert main(["evaluate", fleet.url_of("model"), "--strategies", "", "--reference", fleet.url]) == 1
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nowhere")]) == 1
    assert "no such run root" in capsys.readouterr().err


def test_evaluate_measures_prompt_adherence_for_the_shapes_source(tmp_path):
    from fixtures.random_fleet import write_random_fleet
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import evaluate

    raw = synthetic_config(k=2, size=8, channels=3).to_dict()
    raw["data"]["source"] = "shapes"
    cfg = RunConfig.from_dict(raw)
    root = RunRoot(str(tmp_path / "shapes"))
    write_synthetic_run(root, cfg, per_cluster=8)
    # Rewrite data/ with shapes prompts as captions (the fleet is random: it will not follow them).
    from flowfleet.data.shards import ShardSet, ShardSetManifest

    fields, _ = ShardSet(root, "data").load(with_captions=True)
    captions = [draw_shape(0, i, 8)[1] for i in range(len(fields["index"]))]
    captions[0] = "not a shapes prompt"
    root.remove("data", recursive=True)
    data, manifest = ShardSet(root, "data"), ShardSetManifest()
    data.append(manifest, fields, captions)
    manifest.complete = True
    data.write_manifest(manifest)
    write_random_fleet(root.url, cfg)
    assemble(root.url)
    result = evaluate(
        root.url_of("model"),
        root.url,
        options(strategies=("top1",), monolith=False, diagnostics=False, ref_n=16, n=24),
        extractor=SmallFeatures(),
    )
    adh = result["adherence"]["top1"]
    assert adh["n"] + adh["unparsed"] == 24 and adh["n"] >= 20
    assert 0.0 <= adh["both"] <= adh["colour"] <= 1.0 and adh["both"] <= adh["shape"]
    assert adh["both"] < 0.5  # random weights draw no coloured shapes


JUDGE_MODULE = """
import torch
from flowfleet.evaluate.judge import ClassifierJudge

def make(root):
    # "bright" when the mean pixel is above 0, else "dark"
    def classify(images):
        m = images.float().mean(dim=(1, 2, 3))
        return torch.stack([-m, m], dim=1) * 100
    return ClassifierJudge(classify, [["dark"], ["bright", "light"]], record={"kind": "test"})
"""


def test_repeats_draw_every_model_again_at_its_chosen_scale_as_an_evaluation_with_the_next_seeds(fleet):
    """--repeats R: after the sweep, draws 1 .. R-1 sample each model at its chosen scale with seed + r (other
    prompts, noise, reference and floor): each draw scores exactly what an evaluation with that seed at that
    scale scores; the report gives mean ± sd over the draws and the ratios draw by draw."""
    import statistics

    from flowfleet.evaluate.report import draws_table
    from flowfleet.stages.evaluate import evaluate

    model = fleet.url_of("model")
    opts = options(strategies=("top1", "top2", "full"), guidance_sweep=(1.0, 4.0), repeats=3, diagnostics=False)
    result = evaluate(model, fleet.url, opts, extractor=SmallFeatures())
    draws = result["draws"]
    assert draws["seeds"] == [0, 1, 2] and set(draws["runs"]) == {"monolith", "top1", "top2", "full"}
    assert draws["floor"]["fid"][0] == result["reference_split"]["floor"]["fid"]  # draw 0: the evaluation above
    for name in ("monolith", "top1", "top2"):
        fids = draws["runs"][name]["fid"]
        assert len(fids) == 3 and fids[0] == result["runs"][name]["fid"] and len(set(fids)) == 3, name
        cfg = result["runs"][name]["cfg"]
        alone = dict(strategies=(), monolith=True) if name == "monolith" else dict(strategies=(name,), monolith=False)
        again = evaluate(
            model,
            fleet.url,
            options(**alone, seed=2, sampling=dict(guidance_scale=cfg), diagnostics=False),
            extractor=SmallFeatures(),
        )
        assert draws["runs"][name]["fid"][2] == again["runs"][name]["fid"], name
        assert draws["floor"]["fid"][2] == again["reference_split"]["floor"]["fid"]
    assert draws["runs"]["full"] == draws["runs"]["top2"]  # 2 experts: the same model, not sampled twice

    table = draws_table(draws)
    rows = {row[0]: row for row in table.rows}
    mono, floor = draws["runs"]["monolith"]["fid"], draws["floor"]["fid"]
    assert rows["monolith"][1] == f"{statistics.mean(mono):.2f} ± {statistics.stdev(mono):.2f}"
    over = [m / f for m, f in zip(mono, floor)]
    assert rows["monolith"][2] == f"{statistics.mean(over):.2f} ± {statistics.stdev(over):.2f}"
    paired = [t / m for t, m in zip(draws["runs"]["top1"]["fid"], mono)]
    assert rows["top1"][3] == f"{statistics.mean(paired):.2f} ± {statistics.stdev(paired):.2f}"
    assert rows["monolith"][3] == "" and "real images (the floor)" in rows


def test_user_judge_scores_prompt_accuracy(fleet, tmp_path):
    """--judge MODULE:FACTORY: any classifier over named classes, imported from a .py file."""
    from flowfleet.evaluate.judge import ClassifierJudge, load_judge
    from flowfleet.stages.evaluate import evaluate

    judge_file = tmp_path / "my_judge.py"
    judge_file.write_text(JUDGE_MODULE)
    judge = load_judge(f"{judge_file}:make", fleet)
    assert isinstance(judge, ClassifierJudge)
    images = torch.cat([torch.full((3, 1, 8, 8), -0.5), torch.full((2, 1, 8, 8), 0.5)])
    res = judge.prompt_accuracy(images, ["a dark one"] * 3 + ["a LIGHT one", "a dark one"])
    # 4 hits of 5 averaged in float32 (the per-class shares are rounded to 4 decimals): <= 2 roundings
    assert res["accuracy"] == pytest.approx(4 / 5, rel=gamma(2, torch.float32))
    assert res["per_class"] == {"dark": 0.75, "bright": 1.0}
    assert judge.prompt_accuracy(images[:2], ["dark", "a cat"])["skipped"] == 1

    # the synthetic captions ("item 3 of cluster 0") name no class: refused before any sampling
    with pytest.raises(FlowfleetError, match="judge: none of the 12 prompts names one of the judge's classes"):
        evaluate(
            fleet.url_of("model"),
            fleet.url,
            options(strategies=("top1",), monolith=False, diagnostics=False, judge=f"{judge_file}:make"),
            extractor=SmallFeatures(),
        )

    for bad, message in (
        ("nocolon", "not MODULE:FACTORY"),
        (f"{tmp_path}/missing.py:make", "cannot import"),
        (f"{judge_file}:absent", "no callable 'absent'"),
    ):
        with pytest.raises(FlowfleetError, match=message):
            load_judge(bad, fleet)


# ------------------------------------------------------------------------------------------------
#                       Held-out reference, real floor, guidance sweep
# ------------------------------------------------------------------------------------------------


def test_accuracy_of_285_in_300_meets_a_095_bar():
    """The share is the ratio of counts: 285 hits of 300 is 0.95 and is chosen at min_accuracy 0.95 (a
    float32 mean made it 0.949999988 and the scale was passed over)."""
    from flowfleet.evaluate.judge import ClassifierJudge
    from flowfleet.stages.evaluate import choose_scale

    def classify(images: torch.Tensor) -> torch.Tensor:
        return torch.stack([-images.mean((1, 2, 3)), images.mean((1, 2, 3))], dim=1)  # [B, 2]: dark, bright

    judge = ClassifierJudge(classify, [["dark"], ["bright"]])
    images = torch.ones(300, 1, 4, 4)  # every image bright
    prompts = ["bright"] * 285 + ["dark"] * 15
    result = judge.prompt_accuracy(images, prompts)
    assert result["accuracy"] == 0.95 and result["per_class"] == {"dark": 0.0, "bright": 1.0}
    sweep = [
        {"cfg": 3.5, "classifier_fd": 53.0, "prompt_accuracy": result["accuracy"]},
        {"cfg": 4.5, "classifier_fd": 63.7, "prompt_accuracy": 0.957},
    ]
    assert choose_scale(sweep, 0.95) == 0


def test_choose_scale_takes_the_best_distance_among_accurate_scales():
    from flowfleet.stages.evaluate import choose_scale

    sweep = [
        {"cfg": 1.0, "classifier_fd": 40.0, "fid": 9.0, "prompt_accuracy": 0.80},
        {"cfg": 2.0, "classifier_fd": 55.0, "fid": 8.0, "prompt_accuracy": 0.96},
        {"cfg": 4.0, "classifier_fd": 70.0, "fid": 7.0, "prompt_accuracy": 0.99},
    ]
    assert choose_scale(sweep, 0.95) == 1  # 40 is lower but only 0.80 accurate
    assert choose_scale(sweep, 0.5) == 0
    assert choose_scale(sweep, 0.995) == 2  # none reaches it: the most accurate
    assert choose_scale([{"cfg": c, "fid": f} for c, f in ((1.0, 5.0), (3.0, 4.0))], 0.95) == 1  # no judge: FID


def test_reference_and_real_floor_are_disjoint_sets_drawn_from_the_reference_split():
    from flowfleet.evaluate.reference import ReferenceSplit

    split = ReferenceSplit.draw(1000, 300, None, seed=0, held_out=True)
    floor, ref = set(split.floor.tolist()), set(split.reference.tolist())
    assert len(floor) == 300 and len(ref) == 700 and not floor & ref and floor | ref == set(range(1000))
    assert ReferenceSplit.draw(100, 300, None, 0, False).floor.numel() == 50  # at most half of a small set
    asked = ReferenceSplit.draw(100, 30, 80, 0, True)
    assert (
        asked.reference.numel() == 80
        and asked.floor.numel() == 20
        and not set(asked.floor.tolist()) & set(asked.reference.tolist())
    )
    assert ReferenceSplit.draw(100, 30, 99, 0, True).floor.numel() == 0  # one item left: no floor
    with pytest.raises(FlowfleetError, match=r"^ref_n: 101 reference images requested, eval/ \(the held-out"):
        ReferenceSplit.draw(100, 30, 101, 0, True)


def test_precision_and_recall_of_same_and_of_disjoint_sets():
    from flowfleet.evaluate.precision_recall import precision_recall

    gen = torch.Generator().manual_seed(0)
    real = torch.randn(200, 8, generator=gen)
    same = precision_recall(real, real.clone())
    assert same["precision"] == 1.0 and same["recall"] == 1.0 and same["k"] == 3
    far = precision_recall(real, torch.randn(150, 8, generator=gen) + 100.0)  # nowhere near the real manifold
    assert far["precision"] == 0.0 and far["recall"] == 0.0
    collapsed = precision_recall(real, real[:5].repeat(30, 1))  # every sample a copy of 5 real ones
    assert collapsed["precision"] == 1.0 and collapsed["recall"] < 0.2
    with pytest.raises(FlowfleetError, match="expected features"):
        precision_recall(real, torch.randn(10, 4))


def test_evaluate_against_held_out_items_sweeps_guidance_and_saves_each_folders_choice(tmp_path, caplog):
    """With data.holdout the reference and the real floor come from eval/, disjoint; every model is sampled
    at each swept scale, its row is the chosen scale's, and --save-guidance-scale writes it to the model folders."""
    from fixtures.random_fleet import randomize_, write_random_fleet
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.evaluate.fid import FID, frechet_distance
    from flowfleet.evaluate.reference import ReferenceSplit, reference_images
    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import save_model
    from flowfleet.sampling.folder import read_model_index
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import evaluate

    raw = synthetic_config(k=2, size=8, monolith=True).to_dict()
    raw["data"]["holdout"] = 30
    cfg = RunConfig.from_dict(raw)
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, cfg, per_cluster=8)
    write_random_fleet(root.url, cfg)
    save_model(randomize_(DiTExpert.from_dit_config(cfg.expert), seed=7), root, "monolith", "final")
    root.write_json({"job": "monolith", "state": "done", "step": 1, "total_steps": 1}, "monolith", "status.json")
    assemble(root.url)
    opts = options(
        strategies=("top1", "top2"), ref_n=None, guidance_sweep=(1.0, 4.0), save_guidance_scale=True, diagnostics=False
    )
    with caplog.at_level(logging.WARNING, logger="flowfleet"):
        result = evaluate(root.url_of("model"), root.url, opts, extractor=SmallFeatures())
    # a run with one held-out set (no data.validation): it works, and says that its choices read its figures' images
    said = [r.getMessage() for r in caplog.records if "validation split" in r.getMessage()]
    assert said == [
        f"evaluate: {root.url} has no validation split (run.yaml data.validation): the guidance scale is chosen on "
        "the images it reports"
    ]

    split = result["reference_split"]
    assert (
        split["held_out"] and split["set"] == "eval" and split["reference_images"] == 18 and split["floor"]["n"] == 12
    )
    # the floor is exactly FID(12 held-out items, the other 18): recomputed here from eval/ itself
    from flowfleet.data.shards import ShardSetUnion, open_complete

    held = ShardSetUnion([open_complete(root, "eval", "")]).load(["latents"])["latents"]
    drawn = ReferenceSplit.draw(30, 12, None, seed=0, held_out=True)
    fid = FID(FIDSettings(batch_size=7), "cpu", extractor=SmallFeatures())

    def stats(items):
        return fid.statistics(reference_images(root, cfg, held, items, items.numel(), 7, torch.device("cpu"))())

    assert split["floor"]["fid"] == frechet_distance(stats(drawn.reference), stats(drawn.floor))
    for name in ("monolith", "top1", "top2"):
        run = result["runs"][name]
        scales = [r["cfg"] for r in run["sweep"]]  # (sorted; past 4 where the best was there: extend_sweep)
        assert scales[:2] == [1.0, 4.0] and scales == sorted(scales) and run["chosen_on"] == "test", name
        best = min(run["sweep"], key=lambda r: r["fid"])  # no judge on this data: the lowest FID
        assert run["cfg"] == best["cfg"] and run["fid"] == best["fid"], name
    saved = {name: read_model_index(root.url_of(folder)).scheduler.guidance_scale
             for name, folder in (("top2", "model"), ("monolith", "model-monolith"))}  # fmt: skip
    assert saved == {name: result["runs"][name]["cfg"] for name in saved}  # top2: the folder's default strategy
    assert "guidance.png" not in root.ls("reports")  # (the plot is the report's)
    write_report(root)
    assert root.exists("reports", "plots", "guidance.png")


def test_a_relative_run_root_writes_the_runs_own_evaluation(fleet, monkeypatch):
    """`make demo` passes a relative --out while assemble returns the model folder's absolute path: the
    evaluation of RUN_ROOT/model still goes to reports/evaluation.json, where `report` reads it."""
    import os

    from flowfleet.stages.evaluate import evaluate

    here = os.path.dirname(fleet.url_of())
    monkeypatch.chdir(here)
    before = fleet.read_bytes("reports", "evaluation.json") if fleet.exists("reports", "evaluation.json") else b""
    result = evaluate(
        fleet.url_of("model"),
        os.path.basename(fleet.url_of()),
        options(strategies=("top1",), monolith=False, diagnostics=False, seed=5),
        extractor=SmallFeatures(),
    )
    assert fleet.read_json("reports", "evaluation.json") == result and result["seed"] == 5
    assert fleet.read_bytes("reports", "evaluation.json") != before
    assert not fleet.exists("reports", "model", "evaluation.json")


def test_a_comparison_router_is_evaluated_as_one_more_row_of_the_same_experts(fleet, tmp_path):
    """evaluate routers=("router-prompt",): each strategy again, the same experts routed by the run's prompt-aware
    comparison router (the demo's "beyond Paris" row); refused in one line when unknown or not trained."""
    import shutil

    from fixtures.random_fleet import randomize_

    from flowfleet.config import load_run_config
    from flowfleet.models.dit import DiTRouter
    from flowfleet.models.files import save_model
    from flowfleet.stages.evaluate import evaluate
    from flowfleet.train.specs import JobSpec, router_config

    run = RunRoot(str(shutil.copytree(fleet.url, tmp_path / "run")))
    model = run.url_of("model")
    with pytest.raises(FlowfleetError, match=r"^routers: 'router' is not a comparison router \(one of router-"):
        evaluate(model, run.url, options(routers=("router",)), extractor=SmallFeatures())
    with pytest.raises(FlowfleetError, match=r"^routers: .*router-prompt: missing \(never started\)$"):
        evaluate(model, run.url, options(routers=("router-prompt",)), extractor=SmallFeatures())

    cfg = load_run_config(run)
    aware = router_config(cfg, JobSpec("router-prompt"))
    assert aware.conditioning == "pooled" and not cfg.router.uses_text
    save_model(randomize_(DiTRouter.from_dit_config(aware), seed=11), run, "router-prompt", "final")
    run.write_json(
        {"job": "router-prompt", "state": "done", "step": 1, "total_steps": 1}, "router-prompt", "status.json"
    )
    result = evaluate(
        model,
        run.url,
        options(strategies=("top1",), monolith=False, routers=("router-prompt",)),
        extractor=SmallFeatures(),
    )
    assert list(result["runs"]) == ["top1", "top1+router-prompt"]
    runs = result["runs"]
    assert runs["top1+router-prompt"]["kind"] == "fleet" and runs["top1+router-prompt"]["same_as"] is None
    with np.load(run.url_of("reports", runs["top1"]["samples"])) as a:
        with np.load(run.url_of("reports", runs["top1+router-prompt"]["samples"])) as b:
            assert (a["prompts"] == b["prompts"]).all()  # the same prompts and noise ...
            assert not np.array_equal(a["images"], b["images"])  # ... routed otherwise: other images
    assert runs["top1+router-prompt"]["usage"] != runs["top1"]["usage"]


def test_guidance_rules_are_rows_of_their_own_and_one_model_under_a_prompt_blind_router(fleet, tmp_path):
    """evaluate guidance_rules=("mixture", "expert"): every fleet row under each rule, STRATEGY.RULE[+ROUTER]; under
    the prompt-reading comparison router two fields, under the run's prompt-blind router one model (sampled once);
    the trajectory strategy draws one expert and keeps it (one rule too)."""
    import shutil

    from fixtures.random_fleet import randomize_

    from flowfleet.config import load_run_config
    from flowfleet.models.dit import DiTRouter
    from flowfleet.models.files import save_model
    from flowfleet.stages.evaluate import evaluate
    from flowfleet.train.specs import JobSpec, router_config

    run = RunRoot(str(shutil.copytree(fleet.url, tmp_path / "run")))
    aware = router_config(load_run_config(run), JobSpec("router-prompt"))
    # weights of sd 0.5: a random router whose choice the prompt moves (at 0.1 it hardly does)
    save_model(randomize_(DiTRouter.from_dit_config(aware), seed=11, std=0.5), run, "router-prompt", "final")
    run.write_json(
        {"job": "router-prompt", "state": "done", "step": 1, "total_steps": 1}, "router-prompt", "status.json"
    )
    opts = options(
        strategies=("top1", "trajectory"), monolith=False, routers=("router-prompt",), sampling={"guidance_scale": 3.0}
    )
    result = evaluate(
        run.url_of("model"), run.url, replace(opts, guidance_rules=("mixture", "expert")), extractor=SmallFeatures()
    )
    runs = result["runs"]
    assert list(runs) == [
        "top1.mixture", "top1.expert", "trajectory.mixture", "trajectory.expert",
        "top1.mixture+router-prompt", "top1.expert+router-prompt", "trajectory.mixture+router-prompt",
        "trajectory.expert+router-prompt",
    ]  # fmt: skip
    assert runs["top1.expert"]["same_as"] == "top1.mixture"  # Paris' router: one posterior, one field
    assert runs["trajectory.expert+router-prompt"]["same_as"] == "trajectory.mixture+router-prompt"
    assert runs["top1.expert+router-prompt"]["same_as"] is None
    with np.load(run.url_of("reports", runs["top1.mixture+router-prompt"]["samples"])) as a:
        with np.load(run.url_of("reports", runs["top1.expert+router-prompt"]["samples"])) as b:
            assert (a["prompts"] == b["prompts"]).all() and not np.array_equal(a["images"], b["images"])
    with pytest.raises(
        FlowfleetError, match=r"^guidance_rules: 'both' is not a guidance rule \(one of mixture, expert\)$"
    ):
        evaluate(run.url_of("model"), run.url, options(guidance_rules=("both",)), extractor=SmallFeatures())


def test_another_fleet_in_the_same_latent_space_is_one_more_row_with_the_same_prompts_and_noise(
    fleet, tmp_path, capsys
):
    """evaluate fleets=(("other", FOLDER),): each strategy again sampled by another assembled fleet (e.g. one of
    caption clusters), as the row "top1@other"; its samples are exactly what that fleet draws when evaluated on
    its own against the same reference. A fleet in another latent space or text encoder is refused in one line."""
    import json
    import shutil

    from fixtures.random_fleet import write_random_fleet

    from flowfleet.config import load_run_config
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import evaluate

    other = RunRoot(str(shutil.copytree(fleet.url, tmp_path / "other")))
    write_random_fleet(other.url, load_run_config(other), seed=3)  # other experts and router, the same space
    other_model = assemble(other.url).out
    ref = RunRoot(str(shutil.copytree(fleet.url, tmp_path / "ref")))
    result = evaluate(
        ref.url_of("model"),
        ref.url,
        options(strategies=("top1",), monolith=False, fleets=(("other", other_model),)),
        extractor=SmallFeatures(),
    )
    runs = result["runs"]
    assert list(runs) == ["top1", "top1@other"] and result["fleets"] == {"other": RunRoot(other_model).url}
    alone = evaluate(other_model, ref.url, options(strategies=("top1",), monolith=False), extractor=SmallFeatures())
    with np.load(ref.url_of("reports", runs["top1@other"]["samples"])) as row:
        with np.load(ref.url_of("reports", alone["runs"]["top1"]["samples"])) as direct:
            assert (row["prompts"] == direct["prompts"]).all()
            np.testing.assert_array_equal(row["images"], direct["images"])  # the same fleet, prompts and noise
        with np.load(ref.url_of("reports", runs["top1"]["samples"])) as own:
            assert (own["prompts"] == row["prompts"]).all() and not np.array_equal(own["images"], row["images"])
    for root, mix in ((ref, [{"1": 9, "2": 7}, {"2": 16}]), (other, [{"1": 16}, {"2": 13, "1": 3}])):
        root.write_json(
            {"sizes": [16, 16], "features": {"kind": "semantic"}, "label_mix": mix}, "clusters", "report.json"
        )
    write_report(ref)
    html = ref.read_bytes("reports", "report.html").decode()
    assert "A row STRATEGY@NAME is another fleet" in html and "top1@other" in html
    # the clusters section shows the other fleet's clusters too, from its own run root
    assert "the fleet of the rows STRATEGY@other: semantic clusters" in html and "2: 13, 1: 3" in html

    index = json.loads(other.read_bytes("model", "model_index.json"))
    index["text_width"] += 1
    other.write_json(index, "model", "model_index.json")
    with pytest.raises(FlowfleetError, match=r"^fleet .*other/model: text_width \d+ differs from .*'s \d+: "):
        evaluate(ref.url_of("model"), ref.url, options(fleets=(("other", other_model),)), extractor=SmallFeatures())
    with pytest.raises(FlowfleetError, match=r"^fleet: name 'a b' must be letters"):
        evaluate(ref.url_of("model"), ref.url, options(fleets=(("a b", other_model),)), extractor=SmallFeatures())
    capsys.readouterr()
    assert main(["evaluate", ref.url_of("model"), "--fleet", "nofolder"]) == 1
    assert capsys.readouterr().err.strip() == "flowfleet evaluate: error: --fleet: expected NAME=FOLDER, got 'nofolder'"


def test_held_out_items_join_clusters_by_the_training_items_rule_and_caption_fit():
    from fixtures.synthetic_run import synthetic_config

    from flowfleet.evaluate.generalization import held_out_clusters

    raw = synthetic_config(k=2).to_dict()
    raw["cluster"].update(features="semantic", caption_residual=True)
    cfg = RunConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(0)
    captions = torch.randn(3, 6, generator=gen)[torch.arange(40) % 3]  # [40, 6] three distinct captions
    train = {"features": torch.randn(40, 16, generator=gen), "text_pooled": captions}
    centroids = {"fine": torch.randn(5, 16, generator=gen), "fine_to_coarse": torch.tensor([0, 1, 1, 0, 1])}
    assigned = held_out_clusters(cfg, centroids, train, train)  # [40] the rule on the training items
    assert set(assigned.tolist()) == {0, 1}
    rows = torch.tensor([3, 8, 17, 30])
    held = {name: v[rows] for name, v in train.items()}  # held-out copies of four training items
    # the caption fit is the training items' (fitted on these four alone it would leave other residuals)
    assert torch.equal(held_out_clusters(cfg, centroids, train, held), assigned[rows])


def test_evaluate_reports_each_experts_loss_on_training_and_held_out_items_of_its_cluster(tmp_path):
    from fixtures.random_fleet import randomize_, write_random_fleet
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.data.shards import open_complete
    from flowfleet.evaluate.generalization import held_out_clusters, velocity_loss
    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import load_model, save_model
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import evaluate

    raw = synthetic_config(k=2, size=8, monolith=True).to_dict()
    raw["data"]["holdout"] = 20
    raw["cluster"]["features"] = "latent"  # 64-d clustering features: the latents themselves
    cfg = RunConfig.from_dict(raw)
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, cfg, per_cluster=10)
    train = open_complete(root, "data", "").load(["latents", "text_pooled"])
    held = open_complete(root, "eval", "").load(["latents", "text_pooled"])
    assign = safetensors.torch.load(root.read_bytes("clusters", "assignments.safetensors"))["assign"]
    fine = torch.stack([train["latents"][assign == k].flatten(1).mean(0) for k in (0, 1)])  # [2, 64]
    centroids = {"fine": fine, "coarse": fine.clone(), "fine_to_coarse": torch.tensor([0, 1])}
    root.write_bytes(safetensors.torch.save(centroids), "clusters", "centroids.safetensors")
    write_random_fleet(root.url, cfg)
    save_model(randomize_(DiTExpert.from_dit_config(cfg.expert), seed=7), root, "monolith", "final")
    root.write_json({"job": "monolith", "state": "done", "step": 1, "total_steps": 1}, "monolith", "status.json")
    assemble(root.url)
    result = evaluate(root.url_of("model"), root.url, options(strategies=("top2",)), extractor=SmallFeatures())

    gen = result["diagnostics"]["generalization"]
    held_assign = held_out_clusters(cfg, centroids, train, held)
    # the synthetic clusters differ in brightness: the centroid rule recovers every held-out item's cluster
    assert torch.equal(held_assign, torch.arange(20) % 2)
    monolith = load_model(DiTExpert, root, "monolith", "final")
    for row in gen["clusters"]:
        k = row["expert"]
        assert row["items"] == {"train": 10, "heldout": 10}
        expert = load_model(DiTExpert, root, "model", f"expert_{k}")
        for split, fields, members in (("train", train, assign == k), ("heldout", held, held_assign == k)):
            part = {name: v[members] for name, v in fields.items()}
            for name, model in (("expert", expert), ("monolith", monolith)):
                by_t = velocity_loss(model, part, t_bins=10, draws=1, seed=0, device=torch.device("cpu"))
                assert row[f"{name}_{split}_by_t"] == by_t, (k, name, split)  # the same items and noise
    weights = [r["items"]["heldout"] for r in gen["clusters"]]
    mean = sum(r["expert_heldout"] * w for r, w in zip(gen["clusters"], weights)) / sum(weights)
    assert gen["summary"]["expert"]["heldout"] == pytest.approx(mean, rel=gamma(4))
    # the router on the held-out items, each in its cluster by the same rule: the same items, noise and numbers
    from flowfleet.evaluate.diagnostics import router_accuracy
    from flowfleet.models.dit import DiTRouter

    routed = result["diagnostics"]["router_accuracy_heldout"]
    pick = torch.randperm(20, generator=torch.Generator().manual_seed(0))  # evaluate's seed: 0
    router = load_model(DiTRouter, root, "model", "router")
    expected = router_accuracy(router, held["latents"][pick], held_assign[pick], 2, seed=0)
    assert routed["items"] == 20 and routed["accuracy"] == expected["accuracy"]
    assert routed["confusion"] == expected["confusion"] and "held-out" in routed["note"]
    write_report(root)
    page = (tmp_path / "run/reports/report.html").read_text()
    assert "do the experts generalise?" in page and "expert held-out" in page
    assert "and 20 held-out items" in page


# ------------------------------------------------------------------------------------------------
#                        Choices on the validation split, figures on the test split
# ------------------------------------------------------------------------------------------------


def split_run(path, noise: str | None = None) -> RunRoot:
    """A finished-looking run (random fleet and monolith) holding 40 items out of training, half of them the
    validation split, half the test split; noise: that split's reference images (its items of eval/, a pixel
    space: the latents are the images) replaced by noise."""
    from fixtures.random_fleet import randomize_, write_random_fleet
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import save_model
    from flowfleet.stages.assemble import assemble

    raw = synthetic_config(k=2, size=8, monolith=True).to_dict()
    raw["data"].update(holdout=40, validation=0.5)
    cfg = RunConfig.from_dict(raw)
    root = RunRoot(str(path))
    write_synthetic_run(root, cfg, per_cluster=8)
    write_random_fleet(root.url, cfg)
    save_model(randomize_(DiTExpert.from_dit_config(cfg.expert), seed=7), root, "monolith", "final")
    root.write_json({"job": "monolith", "state": "done", "step": 1, "total_steps": 1}, "monolith", "status.json")
    assemble(root.url)
    if noise is not None:
        noise_split(root, cfg, noise)
    return root


def scores_of(result) -> tuple[dict, dict, dict]:
    """(each row's choice with the validation records it read, each row's test figures, the test floor)."""
    runs = result["runs"]
    choices = {name: (r["cfg"], r["chosen_on"], r["sweep"]) for name, r in runs.items()}
    figures = {name: (r["fid"], result["draws"]["runs"][name]["fid"]) for name, r in runs.items()}
    return choices, figures, result["reference_split"]["floor"]


def test_the_choices_read_only_the_validation_split_and_the_figures_only_the_test_split(tmp_path):
    """With data.validation every guidance scale is chosen on the validation split's draw and every figure comes
    from the test split: test images replaced by noise leave every choice (and every record it read) unchanged while
    the figures change; validation images replaced by noise change the records the choices read, and leave the test
    floor and every row whose choice stands exactly as they were."""
    from flowfleet.stages.evaluate import evaluate

    opts = options(
        strategies=("top1", "top2"), ref_n=None, guidance_sweep=(1.0, 2.0, 4.0), repeats=2, diagnostics=False
    )

    def run(name, noise=None):
        root = split_run(tmp_path / name, noise)
        return evaluate(root.url_of("model"), root.url, opts, extractor=SmallFeatures())

    clean = run("clean")
    assert clean["guidance"]["chosen_on"] == "validation" and clean["reference_split"]["split"] == "test"
    assert clean["validation_split"]["items"] == clean["reference_split"]["items"] == 20
    choices, figures, floor = scores_of(clean)
    assert all(on == "validation" for _, on, _ in choices.values())

    noisy_test = scores_of(run("noisy-test", "test"))
    assert noisy_test[0] == choices  # every choice, and every validation record, to the bit
    for name in figures:
        assert noisy_test[1][name][0] != figures[name][0], name  # the test figures moved
    assert noisy_test[2]["fid"] != floor["fid"]

    noisy_validation = scores_of(run("noisy-validation", "validation"))
    for name, (cfg, _, records) in choices.items():
        assert noisy_validation[0][name][2] != records, name  # the records the choice reads moved
        if noisy_validation[0][name][0] == cfg:  # the same choice: the same figures, every draw
            assert noisy_validation[1][name] == figures[name], name
    assert noisy_validation[2] == floor  # the test split's own floor: untouched


def test_a_sweep_whose_best_scale_sits_at_an_edge_goes_further_until_it_lies_inside(tmp_path, monkeypatch):
    """The sweep 1 / 2 of a model whose validation FID is least at 5: 4 is sampled (the best, 2, was the edge),
    then 8, and 4 lies inside: chosen, nothing said. With the bound at 6 and an FID that keeps falling: 4, then 6
    (the bound), where it stops and says so in evaluation.json and the report."""
    from flowfleet.stages.evaluate import evaluate
    from flowfleet.stages.evaluate.draw import EvaluationDraw

    real = EvaluationDraw._draw
    shape = {"fid": lambda c: (c - 5.0) ** 2}

    def shaped(self, name, pipe, strategy, scale, with_fid, sweep, **choices):
        drawn = real(self, name, pipe, strategy, scale, with_fid, sweep, **choices)
        if self.split_name == "validation":  # the choices' draw: a known distance per scale
            drawn[3]["fid"] = shape["fid"](scale)
        return drawn

    monkeypatch.setattr(EvaluationDraw, "_draw", shaped)
    root = split_run(tmp_path / "run")
    opts = options(strategies=("top2",), monolith=False, ref_n=None, guidance_sweep=(1.0, 2.0), diagnostics=False)
    result = evaluate(root.url_of("model"), root.url, opts, extractor=SmallFeatures())
    run = result["runs"]["top2"]
    assert [r["cfg"] for r in run["sweep"]] == [1.0, 2.0, 4.0, 8.0] and run["cfg"] == 4.0
    assert run["sweep_stop"] is None and run["chosen_on"] == "validation"

    shape["fid"] = lambda c: -c
    result = evaluate(
        root.url_of("model"), root.url, replace(opts, guidance_bounds=(1.0, 6.0)), extractor=SmallFeatures()
    )
    run = result["runs"]["top2"]
    assert [r["cfg"] for r in run["sweep"]] == [1.0, 2.0, 4.0, 6.0] and run["cfg"] == 6.0
    assert run["sweep_stop"] == "the best scale is the bound 6.0"
    assert result["guidance"]["bounds"] == [1.0, 6.0]
    write_report(root)
    assert "The sweep stopped at its bound: top2: the best scale is the bound 6.0." in (
        root.url_of("reports", "report.html") and open(root.url_of("reports", "report.html")).read()
    )


def test_extend_sweep_steps_past_an_edge_by_the_neighbours_ratio_within_its_bounds():
    from flowfleet.stages.evaluate.pieces import extend_sweep

    assert extend_sweep([1.0, 2.0, 4.0], 4.0, (1.0, 16.0), 0, 4) == (8.0, None)
    assert extend_sweep([2.0, 4.0, 8.0], 2.0, (1.0, 16.0), 0, 4) == (1.0, None)
    assert extend_sweep([1.25, 1.5, 2.0], 1.25, (1.0, 16.0), 0, 4)[0] == pytest.approx(1.25 * 1.25 / 1.5)
    assert extend_sweep([4.5, 8.0], 8.0, (1.0, 12.0), 0, 4) == (12.0, None)  # clipped to the bound
    assert extend_sweep([1.0, 2.0, 4.0], 2.0, (1.0, 16.0), 0, 4) == (None, None)  # inside: done
    assert extend_sweep([1.0, 2.0], 1.0, (1.0, 16.0), 0, 4) == (None, "the best scale is the bound 1.0")
    assert extend_sweep([1.0, 2.0], 2.0, (1.0, 16.0), 4, 4) == (
        None,
        "the best scale is the sweep's highest after 4 added scales",
    )
    assert extend_sweep([3.0], 3.0, (1.0, 16.0), 0, 4) == (None, None)  # one scale: no sweep


def test_held_out_splits_are_disjoint_fixed_and_refuse_a_split_too_small():
    from fixtures.synthetic_run import synthetic_config

    from flowfleet.evaluate.reference import HeldOutSplits

    raw = synthetic_config(k=2, size=8).to_dict()
    raw["data"].update(holdout=100, validation=0.3)
    cfg = RunConfig.from_dict(raw)
    splits = HeldOutSplits.of(cfg, 100)
    val, test = set(splits.items("validation").tolist()), set(splits.items("test").tolist())
    assert len(val) == 30 and len(test) == 70 and not val & test and val | test == set(range(100))
    again = HeldOutSplits.of(cfg, 100)  # fixed: every evaluation of the run reads the same split
    assert torch.equal(again.validation, splits.validation) and torch.equal(again.test, splits.test)
    assert HeldOutSplits.of(cfg, None).shared  # nothing held out
    raw["data"]["validation"] = 0.0
    assert HeldOutSplits.of(RunConfig.from_dict(raw), 100).shared  # a run from before the two splits
    raw["data"].update(holdout=3, validation=0.5)
    with pytest.raises(FlowfleetError, match=r"data.validation: 0.5 of the 3 held-out items .* fewer than 2"):
        HeldOutSplits.of(RunConfig.from_dict(raw), 3)
    raw["data"]["validation"] = 1.0
    with pytest.raises(FlowfleetError, match="data.validation"):
        RunConfig.from_dict(raw)


def test_the_summary_prints_every_header_and_figure_whole_in_80_columns():
    """The demo's summary in an 80-column log: the widest rows the demo makes (a comparison router's, another
    fleet's), every column of a judged evaluation, nothing cut."""
    from rich.console import Console

    from flowfleet.evaluate.table import WIDTH, print_table

    run = {
        "guidance_scale": 4.5,
        "prompt_accuracy": 0.7133,
        "confidence": 0.6761,
        "classifier_fd": 124.567,
        "precision": 0.943,
        "recall": 0.504,
        "fid": 1275.45,
        "sampling_s": 14.9,
    }
    names = ("monolith", "top2", "top2+router-prompt", "top2.mixture+router-paris", "top2@caption")
    result = {
        "fid": {"reference_images": 400, "generated_images": 300, "extractor": "default_1-75", "resize": 75},
        "reference_split": {"held_out": True, "split": "test", "floor": {"n": 300, "classifier_fd": 29.93, "fid": 1}},
        "runs": {name: run for name in names},
        "prompt_accuracy": {"classifier": {"judge": "emoji category classifier", "val_accuracy": 0.861}},
        "guidance": {"sweep": [4.5, 8.0], "min_accuracy": 0.0, "chosen_on": "validation"},
        "diagnostics": {"alignment": {"top2": {"assigned_is_dominant": 0.587}}},
    }
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    print_table(result, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= WIDTH and "…" not in text
    headers = ("model", "cfg", "accuracy", "class. FD", "precision", "recall", "FID", "confidence", "in cluster")
    for word in (*headers, "sampling s", *names, "real images", "0.713", "124.57", "1275.5", "0.676", "0.587"):
        assert word in text, word
    assert "on the validation split" in text and "(the test split)" in text
