"""`flowfleet demo`: the whole pipeline on built-in MNIST ends in a report.html with every section."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import install_digit_classifier

from flowfleet.cli import main
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.report import SECTIONS
from flowfleet.presets import preset
from flowfleet.stages.demo import demo, demo_plan
from flowfleet.storage import RunRoot
from flowfleet.train.specs import monolith_steps

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small models on a shared 2-core box


def check_run(path, *, strategies=("top2",), fleets=(), prompt_router=True, paris=True) -> dict:
    """The demo's outputs: a report with every section filled, an evaluation of every model (prompt_router: the
    run was made with --prompt-router; paris: the fleet's router is Paris', as the tiny preset's, else it reads the
    prompt, as the full and quick demos' do)."""
    from test_report import parse  # the report test's headless HTML check

    html = (path / "reports" / "report.html").read_text()
    page = parse(html)
    assert page.sections == list(SECTIONS)
    assert page.missing == {}, page.missing  # nothing left for the user to run
    assert "Not applicable" in html  # adherence: MNIST is not the shapes source
    for section in ("clusters", "training", "samples", "routing", "fid", "diagnostics"):
        assert page.images.get(section), f"section {section} has no image"
    evaluation = json.loads((path / "reports" / "evaluation.json").read_text())
    # the claim (top-2 against the monolith), then the same experts routed by the comparison router
    compared = "router-prompt" if paris else "router-paris"
    assert list(evaluation["runs"]) == [
        "monolith",
        *strategies,
        *(f"{s}+{compared}" for s in strategies if prompt_router),
        *(f"{s}@{f}" for f in fleets for s in strategies),  # --caption-fleet: another fleet, its own rows
    ]
    assert all(v > 0 for v in evaluation["fid"]["scores"].values())
    # MNIST: every model judged by the digit classifier, every scored sample kept with its prompt
    digits = evaluation["prompt_accuracy"]
    assert digits["classifier"]["val_accuracy"] >= 0.97 and list(digits["scores"]) == list(evaluation["runs"])
    for run in evaluation["runs"].values():
        assert 0 <= run["prompt_accuracy"] <= 1 and run["classifier_fd"] > 0
        with np.load(path / "reports" / run["samples"]) as npz:
            assert npz["images"].shape[0] == evaluation["n"] == len(npz["prompts"])
            assert all("handwritten digit" in p for p in npz["prompts"])
    assert "prompt accuracy" in html and "classifier FD" in html and "precision" in html
    # Both routers' accuracy per t-bucket (from their training reports) is in the report: the fleet's, which sees
    # (x_t, t) alone (Paris') or the prompt too, and the comparison router's
    fleets_own, other = ("p(k | x_t, t) (Paris)", "p(k | x_t, t, prompt)")[:: 1 if paris else -1]
    assert fleets_own in html and (other in html) == prompt_router
    router = json.loads((path / "model" / "router" / "config.json").read_text())
    assert (router["conditioning"] == "none") == paris and (router["text_dim"] == 0) == paris
    # judged against held-out digits, beside real ones scored like a model, at each model's swept scale
    split = evaluation["reference_split"]
    assert split["held_out"] and split["floor"]["classifier_fd"] > 0
    assert split["floor"]["n"] == min(evaluation["n"], split["items"] // 2)  # (the floor: at most half the split)
    # the report names the judge and the real images every distance is measured against
    assert split["source"] == json.loads((path / "data" / "manifest.json").read_text())["source"]
    assert "Judge: the mnist digit classifier, trained by flowfleet on the first 4000 MNIST-5k digits" in html
    assert f"Reference: {split['reference_images']} images held out of training (eval/) of MNIST-5k" in html
    swept = list(demo_plan("smoke").evaluation.guidance_sweep)
    assert evaluation["guidance"]["sweep"] == swept and evaluation["guidance"]["chosen_on"] == "validation"
    held = json.loads((path / "eval/manifest.json").read_text())["count"]
    assert split["split"] == "test" and split["items"] + evaluation["validation_split"]["items"] == held
    for run in evaluation["runs"].values():
        # each scale chosen on the validation split (the sweep's records), the row's figures from the test split
        scales = [r["cfg"] for r in run["sweep"]]
        assert run["chosen_on"] == "validation" and set(swept) <= set(scales) and run["cfg"] in scales
        # the judge's classifier FD chooses the scale: no Inception on the validation draw
        assert all("fid" not in r for r in run["sweep"]) and run["fid"] > 0
    assert page.images.get("fid") and "guidance sweep" in html
    # every model drawn again at its chosen scale with the next seeds: the report gives mean ± sd over the draws
    draws = evaluation["draws"]
    assert len(draws["seeds"]) >= 2 and list(draws["runs"]) == list(evaluation["runs"])
    for name, run in evaluation["runs"].items():
        assert draws["runs"][name]["classifier_fd"][0] == run["classifier_fd"]
        assert len(draws["runs"][name]["classifier_fd"]) == len(draws["seeds"])
    assert len(draws["floor"]["classifier_fd"]) == len(draws["seeds"]) and "evaluation draws" in html
    # each expert's and the monolith's loss on training and held-out items of the expert's cluster
    gen = evaluation["diagnostics"]["generalization"]
    assert [r["expert"] for r in gen["clusters"]] == list(range(len(sizes_of(path))))
    assert (
        sum(r["items"]["heldout"] for r in gen["clusters"])
        == json.loads((path / "eval/manifest.json").read_text())["count"]
    )
    assert all(r["expert_heldout"] > 0 and r["monolith_heldout"] > 0 for r in gen["clusters"])
    assert "do the experts generalise?" in html
    # the router on the held-out digits too (it trained on data/'s): every one of them, each bucket in [0, 1]
    held = evaluation["diagnostics"]["router_accuracy_heldout"]
    assert held["items"] == min(512, json.loads((path / "eval/manifest.json").read_text())["count"])
    assert len(held["accuracy"]) == 10 and all(0 <= a <= 1 for a in held["accuracy"])
    assert "held-out items (each in the cluster of its nearest fine centroid)" in html
    timings = json.loads((path / "reports" / "timings.json").read_text())
    assert {"prepare", "cluster", "train-all", "assemble", "generate", "evaluate", "total"} <= set(timings)
    for s in ("monolith", "top1", "top2", "full"):  # the showcase draws every strategy
        assert (path / "reports" / "showcase" / f"{s}.png").exists()
    return evaluation


def sizes_of(path) -> list[int]:
    return json.loads((path / "clusters" / "report.json").read_text())["sizes"]


def test_demo_smoke_runs_every_stage_and_resumes(tmp_path, digit_classifier):
    out = tmp_path / "demo"
    install_digit_classifier(digit_classifier, out)  # trained once per session
    result = demo(str(out), size="smoke", with_prompt_router=True, progress=False)
    assert result.report.endswith("reports/report.html")
    check_run(out)
    # Training jobs, assembled experts and the monolith are all there; the monolith trained the fleet's
    # FLOPs: K x the expert steps (the same architecture) and the router's share on top.
    plan = demo_plan("smoke", prompt_router=True)
    k = plan.config.cluster.k
    status = json.loads((out / "monolith" / "status.json").read_text())
    assert status["state"] == "done" and status["total_steps"] == monolith_steps(plan.config)
    assert status["total_steps"] > k * plan.config.train.steps
    assert sorted(p.name for p in (out / "model").iterdir() if p.name.startswith("expert_")) == [
        f"expert_{i}" for i in range(k)
    ]
    # the experts share K x train.steps by their clusters' sizes, as the full demo's do
    sizes = json.loads((out / "clusters" / "report.json").read_text())["sizes"]
    steps = [json.loads((out / "experts" / str(j) / "status.json").read_text())["total_steps"] for j in range(k)]
    assert sum(steps) == k * plan.config.train.steps
    assert all(abs(s - k * plan.config.train.steps * n / sum(sizes)) < 1 for s, n in zip(steps, sizes))

    # Again with --caption-fleet: the finished stages are skipped, the fleet of caption clusters is trained on a
    # copy of the prepared data (no monolith) and evaluated beside Paris' fleet with the same prompts and noise.
    trained = (out / "experts" / "0" / "status.json").read_bytes()
    demo(str(out), size="smoke", with_caption_fleet=True, with_prompt_router=True, progress=False)
    evaluation = check_run(out, fleets=("caption",))
    assert (out / "experts" / "0" / "status.json").read_bytes() == trained  # resumed, not retrained
    sub = out / "caption-fleet"
    assert evaluation["fleets"] == {"caption": str(sub / "model")}
    assert (sub / "data" / "manifest.json").read_bytes() == (out / "data" / "manifest.json").read_bytes()
    assert json.loads((sub / "clusters" / "report.json").read_text())["features"]["kind"] == "text"
    assert "the fleet of the rows STRATEGY@caption: text clusters" in (out / "reports" / "report.html").read_text()
    assert not (sub / "monolith").exists()
    router = json.loads((sub / "model" / "router" / "config.json").read_text())
    assert router["conditioning"] == "pooled"  # the caption fleet is routed by the prompt
    with np.load(out / "reports" / evaluation["runs"]["top2@caption"]["samples"]) as a:
        with np.load(out / "reports" / evaluation["runs"]["top2"]["samples"]) as b:
            assert (a["prompts"] == b["prompts"]).all() and not np.array_equal(a["images"], b["images"])
    # a copy cut short (its manifest is written last) is copied again; the caption fleet's jobs are not retrained
    (sub / "data" / "manifest.json").unlink()
    caption_trained = (sub / "experts" / "0" / "status.json").read_bytes()
    demo(str(out), size="smoke", with_caption_fleet=True, with_prompt_router=True, progress=False)
    assert (sub / "data" / "manifest.json").read_bytes() == (out / "data" / "manifest.json").read_bytes()
    assert (sub / "experts" / "0" / "status.json").read_bytes() == caption_trained


def test_the_emoji_demo_smoke_runs_every_stage(tmp_path, monkeypatch):
    """`flowfleet demo --data emoji` on a tiny fake set of both art styles: the set's licences in the run, the
    emoji judge's category and subcategory accuracy for every model, the fleet's prompt-reading router with Paris'
    beside it (--prompt-router), the named prompts' grid, a sample file per evaluated row."""
    from fixtures.emoji_packages import fake_packages, many_entries

    from flowfleet.data.sources.emoji import CACHE_FILE, NOTICE_FILE, convert_emoji

    tarballs, arts = fake_packages(tmp_path / "npm", many_entries(30))
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLOWFLEET_CACHE", str(cache))
    convert_emoji(tarballs, cache / CACHE_FILE, cache / NOTICE_FILE, arts=arts, held_out=16, progress=False)
    out = tmp_path / "demo-emoji"
    demo(str(out), size="smoke", data="emoji", with_prompt_router=True, progress=False)
    evaluation = json.loads((out / "reports" / "evaluation.json").read_text())
    assert list(evaluation["runs"]) == ["monolith", "top2", "top2+router-paris"]  # DDM's recipe, Paris' router beside
    judge = evaluation["prompt_accuracy"]["classifier"]
    assert judge["judge"] == "emoji category classifier" and len(judge["sha256"]) == 64
    for run in evaluation["runs"].values():
        assert 0 <= run["prompt_accuracy"] <= 1 and 0 <= run["subcategory_accuracy"] <= 1 and run["classifier_fd"] > 0
        with np.load(out / "reports" / run["samples"]) as npz:
            assert npz["images"].shape[0] == evaluation["n"] == len(npz["prompts"])
            assert npz["images"].shape[-1] == 3 and all(p.endswith(" style") for p in npz["prompts"])
    html = (out / "reports" / "report.html").read_text()
    assert "subcategory accuracy" in html and "DDM&#39;s regime" in html and "+router-paris: Paris&#39; regime" in html
    for name in ("monolith", "top2", "top2+router-paris"):  # the images and prompts of every row
        assert (out / "reports" / "samples" / f"{name}.npz").exists()
    assert "CC-BY-4.0" in (out / "data" / "NOTICE.md").read_text()
    for name in ("monolith", "top1", "top2", "full"):  # the named prompts' grid of every strategy
        assert (out / "reports" / "showcase" / f"{name}.png").exists()


def test_demo_refuses_an_out_folder_of_another_run(tmp_path):
    root = RunRoot(str(tmp_path / "other"))
    preset("mnist-tiny", name="someone-else").save(root)
    with pytest.raises(FlowfleetError, match="exists with another configuration"):
        demo(root.url, size="smoke", progress=False)
    assert not root.exists("data")  # refused before any work


def test_demo_plans_validate_and_quick_is_smaller():
    full, quick = demo_plan("full"), demo_plan("quick")
    # K >= 4 clusters of image features as Paris', top-2; DDM's sampling on them: a router that reads the prompt as the
    # experts do, guidance over the mixture; Paris' compute matching (each expert the batch, its share of the steps)
    for plan in (full, quick):
        c = plan.config
        assert c.cluster.k >= 4 and c.cluster.features == "semantic" and c.encoders.semantic.name == "inception"
        # ... less what the caption predicts of them: every expert holds every digit (docs/training.md)
        assert c.cluster.caption_residual
        assert c.router.conditioning == c.expert.conditioning and c.sampling.strategy.name == "top2"
        assert c.sampling.guidance == "mixture" and c.train.split == "steps"
        # Paris' router beside it is an option (--prompt-router: the comparison router), as the caption fleet is
        assert not c.router_baseline and not c.router_prompt and plan.evaluation.routers == ()
        assert c.train.expert_steps == "by_size"  # each expert passes over its digits as often as the monolith
        # the presets' best scales (the monolith's 2, top-2's 2.5) in the sweep, which goes further past an edge
        # where a model's best lies there
        sweep = plan.evaluation.guidance_sweep
        assert {2.0, 2.5} <= set(sweep) and sweep[-1] > 2.5 and plan.evaluation.guidance_extend >= 1
        assert plan.evaluation.save_guidance_scale
        assert plan.evaluation.repeats >= 3  # figures with their spread over evaluation draws
        # Paris' experts work in a VAE latent: here an autoencoder prepare trains, 8 x 8 x 4, 2 x 2 patches
        assert c.encoders.latent.name == "autoencoder" and c.latent_shape == (4, 8, 8) and c.expert.patch_size == 2
    beside = demo_plan("full", prompt_router=True)
    assert beside.config.router_baseline and beside.evaluation.routers == ("router-paris",)
    assert beside.config.router_train == full.config.router_train  # the same recipe as the fleet's router
    tiny = demo_plan("smoke", prompt_router=True)  # the tiny preset keeps Paris' router: the prompt-aware one beside
    assert not tiny.config.router.uses_text and tiny.evaluation.routers == ("router-prompt",)
    assert quick.config.encoders.latent.autoencoder.steps < full.config.encoders.latent.autoencoder.steps
    assert full.config.data.source == "mnist" and full.config.data.limit is None  # all 5000 digits
    assert full.config.data.holdout == 1000  # the digit judge's validation digits: no model trains on them
    assert quick.config.train.steps < full.config.train.steps
    assert full.evaluation.monolith and full.evaluation.strategies == ("top2",)  # Paris' claim: top-2 vs monolith
    with pytest.raises(ValueError, match="unknown demo size"):
        demo_plan("huge")


def test_the_emoji_demo_plan_is_ddms_recipe_on_content_clusters_paris_router_on_ask():
    full = demo_plan("full", data="emoji")
    c = full.config
    assert c.data.source == "emoji" and c.data.holdout >= 500 and c.data.limit is None  # every image: 6572 to train
    # K >= 4 clusters of image features (of content: no caption residual), none under 5 %, top-2, as Paris; DDM's
    # sampling on them: a router that reads the prompt as the experts do (their conditioning and condition dropout),
    # guidance over the mixture, every expert all the steps at its share of the batch; Paris' router beside it on ask
    assert c.cluster.k >= 4 and c.cluster.features == "semantic" and not c.cluster.caption_residual
    assert c.cluster.min_share >= 0.05 and c.encoders.semantic.name == "inception"
    assert c.router.conditioning == c.expert.conditioning and c.router.cond_dropout == c.expert.cond_dropout > 0
    assert c.sampling.strategy.name == "top2" and c.sampling.guidance == "mixture" and c.train.split == "batch"
    assert not c.router_baseline and not c.router_prompt
    assert full.evaluation.routers == () and full.evaluation.monolith
    assert c.encoders.latent.name == "autoencoder" and c.data.channels == 3
    assert all(p.endswith((", Noto style", ", Twemoji style")) for p in full.data.showcase)
    # the fleet's router already reads the prompt: --prompt-router adds Paris' prompt-blind one and its row
    beside = demo_plan("full", data="emoji", prompt_router=True)
    assert beside.config.router_baseline and beside.evaluation.routers == ("router-paris",)
    with pytest.raises(ValueError, match="unknown demo data 'faces'"):
        demo_plan("full", data="faces")


@pytest.mark.slow
def test_demo_quick_through_the_cli(tmp_path, capsys, digit_classifier):
    out = tmp_path / "demo-quick"
    install_digit_classifier(digit_classifier, out)
    assert main(["demo", "--out", str(out), "--quick"]) == 0
    assert "open" in capsys.readouterr().out
    check_run(out, prompt_router=False, paris=False)
