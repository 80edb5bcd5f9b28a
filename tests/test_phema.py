"""Post-hoc EMA (EDM2): the power-function EMA, its length, and a reconstruction from snapshots of two other lengths
against a power-function EMA of the reconstructed length run directly over the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flowfleet.train.phema import PowerEMA, gamma_of, posthoc_coefficients, reconstruct, sigma_rel_of


class Vector(nn.Module):
    def __init__(self, n: int = 64):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))


def trajectory(steps: int, seed: int = 0):
    """Weights that drift and jitter as an optimiser's do: a slow sinusoid per coordinate plus noise."""
    g = torch.Generator().manual_seed(seed)
    drift = torch.randn(64, generator=g)
    for t in range(1, steps + 1):
        yield drift * math.sin(t / 300) + 0.5 * torch.randn(64, generator=g)


def test_gamma_and_sigma_rel_are_inverse_and_match_edm2():
    """EDM2's two tracked lengths: sigma_rel 0.05 and 0.10 are gamma 16.97 and 6.94 (its Section 3.1)."""
    assert gamma_of(0.05) == pytest.approx(16.97, abs=0.01)
    assert gamma_of(0.10) == pytest.approx(6.94, abs=0.01)
    for s in (0.01, 0.05, 0.13, 0.25):
        assert sigma_rel_of(gamma_of(s)) == pytest.approx(s, rel=1e-9)
    with pytest.raises(ValueError, match="sigma_rel: 0.3 is not in"):
        gamma_of(0.3)


def test_power_ema_weights_the_past_by_tau_to_the_gamma():
    """After t updates the power EMA is sum tau^gamma theta_tau / sum tau^gamma, to the discrete decay's rounding,
    and its buffers are the model's; its state round-trips."""
    model, ema = Vector(), None
    thetas = list(trajectory(600))
    ema = PowerEMA(model, 0.10)
    for i, theta in enumerate(thetas, start=1):
        with torch.no_grad():
            model.w.copy_(theta)
            model.seen.fill_(i)
        ema.update(model)
    tau = torch.arange(1, 601, dtype=torch.float64)
    weights = tau**ema.gamma / (tau**ema.gamma).sum()
    exact = (weights[:, None] * torch.stack(thetas).double()).sum(0)
    spread = torch.stack(thetas).std(0).max().item()
    assert (ema.params["w"].double() - exact).abs().max().item() < 0.01 * spread
    assert int(ema.params["seen"]) == 600
    again = PowerEMA(Vector(), 0.10)
    again.load_state_dict(ema.state_dict())
    assert again.updates == 600 and torch.equal(again.params["w"], ema.params["w"])


@pytest.mark.parametrize("at", [1000, 2000])
def test_reconstruction_equals_a_direct_power_ema_of_that_length(at):
    """Snapshots every 100 steps of sigma_rel 0.05 and 0.10, reconstructed at sigma_rel 0.08 (at the last step and
    at an earlier one): within 1 % of the distance from the direct EMA to the nearer tracked one."""
    model = Vector()
    tracked, direct = [PowerEMA(model, 0.05), PowerEMA(model, 0.10)], PowerEMA(model, 0.08)
    snapshots, at_step = [], {}
    for t, theta in enumerate(trajectory(2000), start=1):
        with torch.no_grad():
            model.w.copy_(theta)
        for ema in (*tracked, direct):
            ema.update(model)
        if t % 100 == 0:
            snapshots += [(t, ema.gamma, {"w": ema.params["w"].clone()}) for ema in tracked]
        if t == at:
            at_step = {"direct": direct.params["w"].clone(), "tracked": [e.params["w"].clone() for e in tracked]}
    got = reconstruct(snapshots, 0.08, step=at)["w"]
    nearest = min((w - at_step["direct"]).abs().max().item() for w in at_step["tracked"])
    assert (got - at_step["direct"]).abs().max().item() < 0.01 * nearest


def test_a_tracked_length_reconstructs_to_itself():
    """Asking for a length that was tracked gives that snapshot's coefficient 1 and the others 0."""
    snaps = [(s, g) for s in (100, 200, 300) for g in (gamma_of(0.05), gamma_of(0.10))]
    x = posthoc_coefficients(snaps, (300, gamma_of(0.10)))
    expected = [0.0] * 5 + [1.0]
    assert x.tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.usefixtures("one_thread")
def test_a_job_keeps_its_snapshots_through_a_stop_and_resume(tmp_path):
    """train.posthoc_ema: a job writes ema/step-*.safetensors every posthoc_every steps and at its last; stopped by
    SIGTERM in step 3 and resumed, its snapshots are bit for bit an uninterrupted job's (the tracked EMAs travel in
    the checkpoint); the snapshots read back reconstruct a tracked length as itself."""
    import os
    import signal

    import safetensors.torch
    from fixtures import synthetic_run
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.storage import RunRoot
    from flowfleet.train.loop import TrainOptions
    from flowfleet.train.phema import read_snapshots
    from flowfleet.train.specs import JobSpec

    options = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)
    cfg = synthetic_config(steps=6, train=dict(posthoc_ema=(0.05, 0.1), posthoc_every=2, ckpt_every=4))
    roots = {}
    for name in ("straight", "resumed"):
        roots[name] = RunRoot(str(tmp_path / name))
        write_synthetic_run(roots[name], cfg)

    def sigterm_in_step_3(call, loss):
        if call == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    assert synthetic_run.run_job(roots["straight"], JobSpec("expert", 0), options).state == "done"
    stopped = synthetic_run.run_job(roots["resumed"], JobSpec("expert", 0), options, sigterm_in_step_3)
    assert (stopped.state, stopped.step) == ("stopped", 3)
    assert synthetic_run.run_job(roots["resumed"], JobSpec("expert", 0), options).state == "done"

    files = sorted(p.name for p in (tmp_path / "straight/experts/0/ema").iterdir())
    assert files == ["step-0000002.safetensors", "step-0000004.safetensors", "step-0000006.safetensors"]
    for name in files:
        a = safetensors.torch.load((tmp_path / "straight/experts/0/ema" / name).read_bytes())
        b = safetensors.torch.load((tmp_path / "resumed/experts/0/ema" / name).read_bytes())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    snaps = read_snapshots(roots["straight"], "experts/0")
    assert sorted((s, round(g, 2)) for s, g, _ in snaps) == [(s, g) for s in (2, 4, 6) for g in (6.94, 16.97)]
    tenth = next(w for s, g, w in snaps if s == 6 and g < 10)
    got = reconstruct(snaps, 0.1)
    assert all(torch.allclose(got[k], tenth[k], atol=1e-5) for k in tenth if tenth[k].is_floating_point())


@pytest.mark.usefixtures("one_thread")
def test_flowfleet_ema_rewrites_final_and_puts_the_trained_one_back(tmp_path, capsys):
    """`flowfleet ema RUN --sigma-rel S`: each finished job's final/ becomes its reconstruction at S and its last
    step (the tracked length 0.1 reconstructs as its own snapshot), final-ema/ keeps the trained final/ once, and
    `--sigma-rel trained` puts it back bit for bit; a length out of range is one line naming the flag."""
    import json

    import safetensors.torch
    from fixtures import synthetic_run
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.cli import main
    from flowfleet.models.files import WEIGHTS_NAME
    from flowfleet.storage import RunRoot
    from flowfleet.train.loop import TrainOptions
    from flowfleet.train.specs import JobSpec

    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, synthetic_config(steps=4, train=dict(posthoc_ema=(0.05, 0.1), posthoc_every=2)))
    options = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)
    assert synthetic_run.run_job(root, JobSpec("expert", 0), options).state == "done"
    job = tmp_path / "run/experts/0"
    weights = lambda folder: safetensors.torch.load((job / folder / WEIGHTS_NAME).read_bytes())  # noqa: E731
    trained = weights("final")

    assert main(["ema", str(tmp_path / "run"), "--sigma-rel", "0.1"]) == 0
    assert "expert-0: final/ is the EMA of sigma_rel 0.1 at step 4 (4 snapshots)" in capsys.readouterr().out
    snapshot = safetensors.torch.load((job / "ema/step-0000004.safetensors").read_bytes())
    now = weights("final")
    assert now.keys() == trained.keys()
    for name, value in now.items():
        assert torch.allclose(value, snapshot[f"0.1/{name}"], atol=1e-5), name
    assert not all(torch.equal(now[k], trained[k]) for k in now)  # (training's EMA is another average)
    assert json.loads((job / "posthoc_ema.json").read_text()) == {"sigma_rel": 0.1, "step": 4, "snapshots": [2, 4]}

    assert main(["ema", str(tmp_path / "run"), "--sigma-rel", "0.07"]) == 0  # a second length: final-ema/ kept
    assert main(["ema", str(tmp_path / "run"), "--sigma-rel", "trained"]) == 0
    assert all(torch.equal(weights("final")[k], trained[k]) for k in trained)
    capsys.readouterr()
    assert main(["ema", str(tmp_path / "run"), "--sigma-rel", "0.4"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("--sigma-rel: 0.4 is not in (0, 0.2887)"), err


@pytest.mark.usefixtures("one_thread")
def test_the_ema_length_is_chosen_on_the_validation_split_and_never_reads_the_test_split(tmp_path, capsys):
    """`flowfleet ema RUN --choose`: every length is sampled on the validation split's draw, the fleet and the
    monolith each keep the length of their lowest distance, and final/ of their jobs is that length's
    reconstruction, assembled into the model folders. The test split's images replaced by noise leave every score
    and choice as they were; the validation split's replaced change the scores the choice reads."""
    import json
    import shutil

    import safetensors.torch
    from fixtures import synthetic_run
    from fixtures.held_out import SmallFeatures, noise_split
    from fixtures.synthetic_run import synthetic_config, write_synthetic_run

    from flowfleet.config import RunConfig
    from flowfleet.errors import ParameterError
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.models.files import WEIGHTS_NAME
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import EvaluateOptions
    from flowfleet.stages.evaluate.pieces import distance
    from flowfleet.stages.posthoc_ema import choose_posthoc_ema
    from flowfleet.storage import RunRoot
    from flowfleet.train.loop import TrainOptions
    from flowfleet.train.phema import read_snapshots
    from flowfleet.train.specs import fleet_jobs

    raw = synthetic_config(k=2, steps=4, monolith=True, train=dict(posthoc_ema=(0.05, 0.12), posthoc_every=2)).to_dict()
    raw["data"].update(holdout=40, validation=0.5)
    cfg = RunConfig.from_dict(raw)
    trained = RunRoot(str(tmp_path / "trained"))
    write_synthetic_run(trained, cfg, per_cluster=8)
    options = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)
    for spec in fleet_jobs(cfg):
        assert synthetic_run.run_job(trained, spec, options).state == "done", spec.name
    assemble(trained.url)

    draw = EvaluateOptions(n=10, batch_size=5, device="cpu", fid=FIDSettings(batch_size=7), diagnostics=False)
    lengths = (0.05, 0.08, 0.12)

    def choose(name: str, noise: str | None = None) -> tuple[RunRoot, dict]:
        shutil.copytree(tmp_path / "trained", tmp_path / name)
        root = RunRoot(str(tmp_path / name))
        if noise is not None:
            noise_split(root, cfg, noise)
        return root, choose_posthoc_ema(root.url, lengths, draw, extractor=SmallFeatures())

    root, record = choose("clean")
    assert record["split"] == "validation" and [r["sigma_rel"] for r in record["lengths"]] == list(lengths)
    for model in ("fleet", "monolith"):
        best = min(record["lengths"], key=lambda r: distance(r[model]))["sigma_rel"]
        assert record["chosen"][model] == best, model
    assert json.loads((tmp_path / "clean/reports/posthoc_ema.json").read_text()) == record

    def weights(*path):
        return safetensors.torch.load((tmp_path / "clean").joinpath(*path, WEIGHTS_NAME).read_bytes())

    from flowfleet.train.phema import reconstruct

    for job, model, folder in (
        ("experts/0", "fleet", "model/expert_0"),
        ("monolith", "monolith", "model-monolith/expert_0"),
    ):
        expected = reconstruct(read_snapshots(root, job), record["chosen"][model])  # at its last step
        final, served = weights(job, "final"), weights(*folder.split("/"))
        for key, value in final.items():
            if value.is_floating_point():
                assert torch.allclose(value, expected[key], atol=1e-5), (job, key)
            assert torch.equal(served[key], value), (folder, key)  # the model folder is assembled from it

    _, noisy_test = choose("noisy-test", "test")
    assert noisy_test["lengths"] == record["lengths"] and noisy_test["chosen"] == record["chosen"]
    _, noisy_validation = choose("noisy-validation", "validation")
    for clean, noisy in zip(record["lengths"], noisy_validation["lengths"]):
        assert distance(noisy["fleet"]) != distance(clean["fleet"]) and distance(noisy["monolith"]) != distance(
            clean["monolith"]
        )

    with pytest.raises(ParameterError, match="a choice needs two lengths or more"):
        choose_posthoc_ema(root.url, (0.1,), draw, extractor=SmallFeatures())
    from flowfleet.cli import main

    capsys.readouterr()
    assert main(["ema", root.url, "--choose", "0.1,0.5"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("--choose: 0.5 is not in (0, 0.2887)"), err
