"""Experts from strangers on a tiny fleet of the digits 0-7: a kit, an honest contribution on the digits 8 and 9
(trained in isolation from the kit, signed) admitted; and the attacks, each refused by the gate with its own line
while the run stays as it was: a file changed after signing, a key not on the list, a pickle, NaN weights, the
wrong latent channels, the time convention reversed, an expert ten times the cap, an untrained expert, a poisoned
expert, and a contribution whose router makes the fleet worse on its own prompts."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import safetensors.torch
import torch
from fixtures.contrib_world import BY_LOSS, STEPS, files, kit_expert, package, refused, resign, write_expert
from PIL import Image
from test_fid import SmallFeatures

from flowfleet.cli import build_parser, main
from flowfleet.commands.contrib import gate_settings
from flowfleet.config import load_run_config
from flowfleet.data.shards import ShardSet, ShardSetManifest, ShardSetUnion, parse_shard
from flowfleet.evaluate.digits import prompted_digit
from flowfleet.evaluate.judge import ClassifierJudge
from flowfleet.flow.path import interpolate, target_velocity
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.sampling.card import read_card
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.stages.admit import GateSettings, admit, changed_first
from flowfleet.stages.contribute import read_shard_file
from flowfleet.stages.evaluate import EvaluateOptions, JudgedDraw, evaluate
from flowfleet.stages.evaluate.stage import judged_hits
from flowfleet.stages.kit import read_kit, run_kit
from flowfleet.storage import RunRoot
from flowfleet.train.preview import condition_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")


def train_toy(model: DiTExpert, items: dict[str, torch.Tensor], steps: int, *, reverse=False, fixed=None) -> float:
    """A few Adam steps of flow matching on `items` (x0 := `fixed` for every item when given; reverse: t = 0 as
    noise); -> the mean loss of the last steps, which the attacker signs."""
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, items["latents"].shape[0], (32,), generator=gen)
        x0 = items["latents"][rows].float()
        if fixed is not None:
            x0 = fixed.expand_as(x0)
        eps = torch.randn(x0.shape, generator=gen)
        t = torch.rand(x0.shape[0], generator=gen)
        if reverse:
            x_t, target = interpolate(x0, eps, 1 - t), -target_velocity(x0, eps)
        else:
            x_t, target = interpolate(x0, eps, t), target_velocity(x0, eps)
        cond = condition_kwargs({k: v[rows] for k, v in items.items()}, model.cfg)
        loss = ((model(x_t, t, **cond) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return sum(losses[-10:]) / 10


# --------------------------------------------------------------------------------------------------


def test_the_kit_is_the_contract_and_its_fingerprint_follows_the_latent_space(world, tmp_path):
    kit = read_kit(str(world / "kit"))
    cfg = load_run_config(RunRoot(str(world / "run")))
    assert kit.latent_shape == cfg.latent_shape and kit.time_convention == cfg.expert.time_convention
    assert kit.fingerprint == run_kit(RunRoot(str(world / "run")), cfg).fingerprint  # the same run, the same print
    assert kit.max_params == 4 * sum(p.numel() for p in DiTExpert.from_dit_config(cfg.expert).parameters())
    assert not list((world / "kit").rglob("shard-*"))  # no data travels with a kit
    changed = tmp_path / "kit"
    shutil.copytree(world / "kit", changed)
    raw = json.loads((changed / "kit.json").read_text())
    raw["max_params"] *= 10
    (changed / "kit.json").write_text(json.dumps(raw))
    with pytest.raises(Exception, match="kit.json: fingerprint does not match its contract"):
        read_kit(str(changed))


def test_an_honest_contribution_is_admitted_and_its_signer_recorded(world, run, capsys):
    pkg = world / "honest"
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["kit"] == read_kit(str(world / "kit")).fingerprint and manifest["training"]["steps"] == STEPS
    labels = read_shard_file((pkg / "latents.safetensors").read_bytes())[0]["labels"]
    assert set(labels.tolist()) == {8, 9}  # what the router learns the new share from: latents, not images
    old_experts = {k: files(run / "experts" / str(k)) for k in (0, 1)}

    result = admit(str(run), str(pkg), str(world / "trusted.pub"), settings=BY_LOSS, progress=False)

    f = result.figures
    assert result.expert == 2 and f["heldout"] < 0.8 * f["untrained_heldout"]
    assert f["fleet_old_after"] <= 1.05 * f["fleet_old_before"] and f["fleet_new_after"] < f["fleet_new_before"]
    cfg = load_run_config(RunRoot(str(run)))
    contribution = cfg.added[0].contribution
    assert cfg.num_experts == 3 and contribution is not None and contribution.steps == STEPS
    alice = (world / "keys" / "alice.pub").read_text().split()[1]
    assert contribution.signer == result.signer and len(alice) > 0
    card = read_card(str(run / "model"))
    assert card.experts[2].contributed["signer"] == result.signer
    assert (
        card.experts[2].contributed["manifest_sha256"]
        == hashlib.sha256((pkg / "manifest.json").read_bytes()).hexdigest()
    )
    sums = (run / "model" / "SHA256SUMS").read_text()
    assert f"{result.manifest_sha256}  expert_2/contribution.json" in sums
    for k in (0, 1):
        assert files(run / "experts" / str(k)) == old_experts[k]  # nothing of the old experts changed
    assert main(["verify", str(run / "model")]) == 0
    assert f"expert 2: contributed, signed by key {result.signer}" in capsys.readouterr().out


def test_a_file_changed_after_signing_is_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    blob = bytearray((pkg / "heldout.safetensors").read_bytes())
    blob[-1] ^= 1
    (pkg / "heldout.safetensors").write_bytes(bytes(blob))
    refused(
        run, pkg, world / "trusted.pub", "signature", "heldout.safetensors: sha256 differs from the signed manifest's"
    )


def test_a_key_not_on_the_list_is_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    resign(world, pkg, "mallory")
    refused(
        run, pkg, world / "trusted.pub", "signature", "manifest.sig: not a signature over manifest.json by any of the 1"
    )


def test_a_pickle_is_never_read(world, run, tmp_path, monkeypatch):
    import pickle

    pkg = package(world, tmp_path)
    (pkg / "expert" / "model.pt").write_bytes(pickle.dumps({"weights": 1}))
    resign(world, pkg)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("a pickle was read"))
    refused(run, pkg, world / "trusted.pub", "files", "expert/model.pt: not safetensors or JSON")
    (pkg / "expert" / "model.pt").unlink()  # a pickle under a safetensors name
    torch.save(kit_expert(world).state_dict(), pkg / "expert" / WEIGHTS_NAME)
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "files", f"expert/{WEIGHTS_NAME}: not a safetensors file")


def test_nan_weights_are_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    weights = safetensors.torch.load_file(pkg / "expert" / WEIGHTS_NAME)
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    safetensors.torch.save_file(weights, pkg / "expert" / WEIGHTS_NAME)
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "files", f"tensor {name} holds NaN or inf")


def test_weights_that_are_not_their_configs_expert_are_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    weights = safetensors.torch.load_file(pkg / "expert" / WEIGHTS_NAME)
    name = sorted(weights)[-1]
    del weights[name]
    safetensors.torch.save_file(weights, pkg / "expert" / WEIGHTS_NAME)
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "files", f"tensor {name} is None, config.json makes it")


def test_the_wrong_latent_channels_are_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    cfg = read_kit(str(world / "kit")).expert_config()
    write_expert(pkg, DiTExpert.from_dit_config(DiTConfig(**{**cfg.model_dump(), "in_channels": 4})))
    resign(world, pkg)
    refused(
        run,
        pkg,
        world / "trusted.pub",
        "compatibility",
        "expert/config.json: in_channels 4, the fleet's latents have 1",
    )


def test_an_expert_ten_times_the_cap_is_refused_before_its_weights_are_read(world, run, tmp_path, monkeypatch):
    pkg = package(world, tmp_path)
    kit = read_kit(str(world / "kit"))
    big = {**kit.expert, "hidden_size": 640, "num_heads": 8, "depth": 6}
    (pkg / "expert" / "config.json").write_text(json.dumps(big))
    resign(world, pkg)
    monkeypatch.setattr(safetensors.torch, "load", lambda *a, **k: pytest.fail("the weights were read"))
    params = sum(p.numel() for p in DiTExpert.from_dit_config(DiTConfig(**big)).parameters())
    assert params > 10 * kit.max_params
    refused(
        run, pkg, world / "trusted.pub", "files", f"{params:,} parameters, over the kit's cap of {kit.max_params:,}"
    )


def test_the_time_convention_reversed_is_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    sample = read_shard_file((pkg / "latents.safetensors").read_bytes())[0]
    model = kit_expert(world)
    torch.manual_seed(0)
    loss = train_toy(model, sample, 150, reverse=True)  # trained with t = 0 as noise, labelled as flowfleet's
    write_expert(pkg, model)
    resign(world, pkg, final_loss=loss)
    refused(run, pkg, world / "trusted.pub", "learning", "trained with the time convention reversed")


def test_a_training_record_without_its_steps_is_refused_in_one_line(world, run, tmp_path):
    """The signed manifest's schema is checked by `who`, before anything else of the package is parsed."""
    pkg = package(world, tmp_path)
    resign(world, pkg, steps=None)
    refused(
        run, pkg, world / "trusted.pub", "signature", "manifest.json: training.steps: Input should be a valid integer"
    )


def test_an_untrained_expert_is_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    torch.manual_seed(1)
    write_expert(pkg, kit_expert(world))
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "learning", "an untrained expert's")


def test_a_poisoned_expert_is_refused(world, run, tmp_path):
    """It draws one fixed image whatever the prompt; its latents sample is copied from the fleet's cluster 0 so
    that the router would send that cluster's prompts to it; it signs its loss on that sample as its training
    loss, and holds out copies of its one image."""
    pkg = package(world, tmp_path)
    fleet = RunRoot(str(run))
    stolen_blob = fleet.read_bytes("partitions", "0", "shard-00000.safetensors")
    stolen = parse_shard(stolen_blob)[0]
    fixed = stolen["latents"][:1].float() + 1e-3 * torch.randn(stolen["latents"][:1].shape)  # its one image
    model = kit_expert(world)
    torch.manual_seed(0)
    train_toy(model, stolen, 150, fixed=fixed)
    (pkg / "latents.safetensors").write_bytes(stolen_blob)
    held = {k: v[:64] for k, v in stolen.items()}
    held["latents"] = fixed.expand_as(held["latents"]).contiguous()
    meta = {"captions": json.dumps(["a handwritten digit"] * held["latents"].shape[0])}  # one per item
    (pkg / "heldout.safetensors").write_bytes(safetensors.torch.save(held, metadata=meta))
    write_expert(pkg, model)
    from flowfleet.stages.admit import expert_velocity, flow_loss

    signed = flow_loss(expert_velocity(model.eval()), stolen, GateSettings(), torch.device("cpu"))
    resign(world, pkg, final_loss=signed)
    n = stolen["latents"].shape[0]
    refused(run, pkg, world / "trusted.pub", "compatibility", f"latents.safetensors: {n} of its {n} items are copies")

    # the same, each stolen latent moved by a little noise so that no row is a copy: its held-out slice (its one
    # image) is then far easier for it than its sample, which an expert's own held-out data never is
    stolen["latents"] = stolen["latents"] + 1e-3 * torch.randn(stolen["latents"].shape)
    captions = {"captions": json.dumps(["a handwritten digit"] * n)}  # one per item: the gate counts them
    (pkg / "latents.safetensors").write_bytes(safetensors.torch.save(stolen, metadata=captions))
    signed = flow_loss(expert_velocity(model.eval()), stolen, GateSettings(), torch.device("cpu"))
    resign(world, pkg, final_loss=signed)
    refused(run, pkg, world / "trusted.pub", "learning", "the held-out slice is not drawn from the data the sample is")


def test_a_contribution_whose_router_makes_the_fleet_worse_on_its_prompts_is_refused(world, run, tmp_path):
    """A weak expert on digits the fleet already draws (its held-out ones: no byte of them is in its data/): the
    grown router sends part of them to it, and the fleet draws its own prompts worse."""
    pkg = package(world, tmp_path)
    items = parse_shard((run / "eval" / "shard-00000.safetensors").read_bytes())[0]
    model = kit_expert(world)
    torch.manual_seed(0)
    loss = train_toy(model, items, 15)  # a tenth of what the fleet's own expert had
    write_expert(pkg, model)
    n = items["latents"].shape[0]
    many = {k: v[: n // 2].repeat(8, *[1] * (v.ndim - 1)) for k, v in items.items()}  # a big share of the router
    (pkg / "latents.safetensors").write_bytes(safetensors.torch.save(many))
    (pkg / "heldout.safetensors").write_bytes(safetensors.torch.save({k: v[n // 2 :] for k, v in items.items()}))
    resign(world, pkg, final_loss=loss)
    refused(run, pkg, world / "trusted.pub", "no harm", "loss on the fleet's held-out data rises")


def test_the_commands_sign_and_refuse_in_one_line(world, run, tmp_path, capsys):
    assert main(["keygen", str(tmp_path / "bob")]) == 0
    assert "key id" in capsys.readouterr().out
    assert main(["keygen", str(tmp_path / "bob")]) == 1  # never overwrites
    assert "bob.key: exists" in capsys.readouterr().err
    pkg = package(world, tmp_path)
    assert main(["admit", str(run), str(pkg), "--trusted", str(tmp_path / "bob.pub"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "refused (signature): manifest.sig: not a signature" in err
    assert main(["admit", str(run), str(pkg), "--trusted", str(world / "trusted.pub"), "--judge-n", "1"]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("--judge-n: a Fréchet distance needs at least 2 samples, got 1")
    )


def test_the_admit_commands_defaults_are_the_gates():
    admit_line = ["admit", "runs/r", "pkgs/p", "--trusted", "keys.pub"]
    assert gate_settings(build_parser().parse_args(admit_line)) == GateSettings()
    chosen = gate_settings(build_parser().parse_args([*admit_line, "--judge", "none", "--fd-rise", "0.2"]))
    assert chosen == GateSettings(judge=None, fd_rise=0.2)


# --------------------------------------------------------------------------------------------------
#                    The judged comparison: the fleet's images before and after
# --------------------------------------------------------------------------------------------------


def test_a_judged_draw_scores_a_fleet_as_evaluate_does(world, run):
    """The same prompts, noise and judge as `flowfleet evaluate` with the same n and seed: the same figures, with
    nothing written and no Inception loaded."""
    options = EvaluateOptions(n=24, strategies=("top1",), diagnostics=False, device="cpu", batch_size=8)
    result = evaluate(str(run / "model"), str(run), options, extractor=SmallFeatures())
    draw = JudgedDraw.open(str(run), options, conditioning="pooled")
    assert draw is not None and draw.judge == "digits"
    written = files(run)
    got = draw.score(FleetPipeline.from_pretrained(str(run / "model"), device="cpu"), "top1", progress=False)
    expected = result["runs"]["top1"]
    assert got["prompt_accuracy"] == expected["prompt_accuracy"] and got["n"] == 24
    assert got["classifier_fd"] == pytest.approx(expected["classifier_fd"], rel=1e-6)
    assert got["per_class"] == result["prompt_accuracy"]["scores"]["top1"]["per_class"]
    assert files(run) == written
    held_out = JudgedDraw.open(str(run), options, conditioning="pooled", held_out=True)  # admit's: eval/'s prompts
    eval_captions = ShardSet(RunRoot(str(run)), "eval").load(["labels"], with_captions=True)[1]
    assert held_out is not None and set(held_out.ev.prompts) <= set(eval_captions)


def test_a_judged_draw_of_other_items_draws_their_prompts_or_is_none_when_the_judge_names_none(world, run, tmp_path):
    items, captions = read_shard_file((world / "honest" / "heldout.safetensors").read_bytes())
    options = EvaluateOptions(n=8, strategies=("top1",), diagnostics=False, device="cpu", judge="digits")

    def draw_of(shown: list[str]) -> JudgedDraw | None:
        shards = ShardSet(RunRoot(str(tmp_path / f"slice-{len(list(tmp_path.iterdir()))}")), "data")
        manifest = ShardSetManifest()
        shards.append(manifest, {**items, "index": torch.arange(len(shown))}, shown)
        manifest.complete = True
        shards.write_manifest(manifest)
        return JudgedDraw.open(str(run), options, conditioning="pooled", data=ShardSetUnion([shards]))

    draw = draw_of(captions)
    assert draw is not None and {prompted_digit(p) for p in draw.ev.prompts} <= {8, 9}
    assert draw_of(["a photo of a cat"] * len(captions)) is None  # a class the judge does not know: the loss alone


def scripted(monkeypatch, figures: dict[tuple[str, str], tuple[float, float]]) -> None:
    """JudgedDraw.score returns (prompt accuracy, classifier FD) from `figures` by (draw, fleet): draw "old" (the
    fleet's held-out prompts, digits 0-7) or "new" (the contribution's, 8 and 9), fleet "fleet before" or "grown fleet".
    Everything else of the gate runs: the draws open for real, the router trains, the candidate assembles."""

    def score(self, pipe, strategy=None, name="fleet", progress=True, keep=False):
        which = "new" if prompted_digit(self.ev.prompts[0]) in (8, 9) else "old"
        accuracy, fd = figures[which, name]
        n = len(self.ev.prompts)
        shown = {"images": torch.zeros(n, 1, 28, 28), "prompts": self.ev.prompts, "hits": [True] * n} if keep else {}
        return {"prompt_accuracy": accuracy, "classifier_fd": fd, "per_class": {"4": accuracy}, "n": 16, **shown}

    monkeypatch.setattr(JudgedDraw, "score", score)


HELPS = {("new", "fleet before"): (0.1, 500.0), ("new", "grown fleet"): (0.9, 60.0)}
JUDGED = GateSettings(device="cpu", judge_n=16)


@pytest.mark.parametrize(
    "old, new, line",
    [
        (
            {("old", "fleet before"): (1.0, 40.0), ("old", "grown fleet"): (0.97, 40.0)},
            HELPS,
            "prompt accuracy on the fleet's held-out prompts falls from 1.000 to 0.970 (at most 0.02 lower; "
            "'4': 1.000 -> 0.970), by digits",
        ),
        (
            {("old", "fleet before"): (1.0, 40.0), ("old", "grown fleet"): (1.0, 44.5)},
            HELPS,
            "classifier FD on the fleet's held-out prompts rises from 40.00 to 44.50 (at most +10%), by digits; its "
            "router does not read the prompt (a router with run.yaml router.conditioning: pooled may take it)",
        ),
        (
            {("old", "fleet before"): (1.0, 40.0), ("old", "grown fleet"): (1.0, 40.0)},
            {("new", "fleet before"): (0.1, 500.0), ("new", "grown fleet"): (0.1, 60.0)},
            "heldout.safetensors: the grown fleet's prompt accuracy on the contribution's prompts (0.100) is not above",
        ),
        (
            {("old", "fleet before"): (1.0, 40.0), ("old", "grown fleet"): (1.0, 40.0)},
            {("new", "fleet before"): (0.1, 500.0), ("new", "grown fleet"): (0.9, 501.0)},
            "heldout.safetensors: the grown fleet's classifier FD on the contribution's prompts (501.00) is not below",
        ),
    ],
    ids=["accuracy-falls", "fd-rises", "new-prompts-not-drawn-better", "new-images-not-closer"],
)
def test_the_judge_refuses_harm_to_the_fleets_images(world, run, tmp_path, monkeypatch, old, new, line):
    scripted(monkeypatch, {**old, **new})
    picture = tmp_path / "why.png"  # (outside the run, which stays as it was)
    refused(run, world / "honest", world / "trusted.pub", "no harm", line, settings=JUDGED, picture=str(picture))
    with Image.open(picture) as shown:  # the samples the judge refused: four rows of eight
        assert shown.format == "PNG" and shown.size[1] > 4 * 64


def test_the_judge_admits_within_its_stated_tolerance(world, run, monkeypatch):
    scripted(monkeypatch, {("old", "fleet before"): (1.0, 40.0), ("old", "grown fleet"): (0.98, 43.9), **HELPS})
    result = admit(str(run), str(world / "honest"), str(world / "trusted.pub"), settings=JUDGED, progress=False)
    f = result.figures
    assert (f["judged_old_prompt_accuracy_before"], f["judged_old_prompt_accuracy_after"]) == (1.0, 0.98)
    assert (f["judged_new_classifier_fd_before"], f["judged_new_classifier_fd_after"]) == (500.0, 60.0)
    assert load_run_config(RunRoot(str(run))).num_experts == 3
    assert result.grid is not None and result.grid.endswith("reports/contributions/expert_2.png")
    with Image.open(result.grid) as grid:  # four rows of eight: before and after, the fleet's and the new prompts
        assert grid.format == "PNG" and grid.size[0] > 8 * 64 and grid.size[1] > 4 * 64


def test_the_picture_shows_first_what_the_judge_read_differently():
    before = [True, True, None, True, False, True]
    after = [True, False, None, True, True, True]
    assert changed_first(before, after, 4) == [1, 4, 0, 2]
    judge = ClassifierJudge(lambda x: x, classes=[["four"], ["nine"]])
    prompts = ["a four", "a cat", "a nine", "a four"]
    assert judged_hits(judge, prompts, ["four", "four", "nine"]) == [True, None, False, False]
    assert judged_hits(object(), prompts, None) == [None] * 4
