"""The training recipe's options reach an expert's loss: the time sampler's parameters, the weighting over t, the
dispersive regulariser."""

from __future__ import annotations

import pytest
import torch
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.config import RunConfig, load_run_config
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow import alignment_loss, dispersive_loss, flow_matching_loss, loss_weight
from flowfleet.storage import RunRoot
from flowfleet.train import preview
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import build_task

RECIPE = {"time_sampling": "logit_normal", "time_mean": 0.8, "time_std": 0.5, "loss_weighting": "min_snr"}


def expert_loss(tmp_path, train: dict, repa_dim: int = 0):
    """Expert 0's task of a small run with these train settings (and expert.repa_dim), a fresh model (seed 0), eight
    items, and its loss at generator seed 3: (root, task, model, batch, (loss, extras))."""
    cfg = synthetic_config(k=2, train=train)
    if repa_dim:
        raw = cfg.to_dict()
        raw["expert"]["repa_dim"] = repa_dim
        cfg = RunConfig.from_dict(raw)
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, cfg, per_cluster=[12, 10], shard_size=6)
    task = build_task(root, cfg, JobSpec("expert", 0))
    torch.manual_seed(0)
    model = task.build_model()
    batch = task.data.gather(torch.arange(8))
    return root, task, model, batch, task.loss(model, batch, torch.Generator().manual_seed(3))


def test_an_experts_loss_draws_t_by_its_sampler_and_weights_it(tmp_path):
    """FlowTask.loss under train.time_* and loss_weighting: the replayed draws (t by the job's sampler, the noise, the
    condition dropout) give the Min-SNR-weighted flow-matching loss, which differs from the plain one."""
    _, task, model, batch, (loss, _) = expert_loss(tmp_path, {**RECIPE, "min_snr_gamma": 2.0})

    gen = torch.Generator().manual_seed(3)
    x0 = batch["latents"]
    t = torch.sigmoid(0.8 + 0.5 * torch.randn(8, generator=gen))  # the job's logit-normal(0.8, 0.5)
    eps = torch.randn(x0.shape, generator=gen)
    drop = torch.rand(8, generator=gen) < task.model_cfg.cond_dropout
    cond = preview.condition_kwargs(batch, task.model_cfg)
    velocity = lambda x_t, tt: model(x_t, tt, drop=drop, **cond)  # noqa: E731
    weight = loss_weight(t, "min_snr", 2.0)
    assert torch.allclose(weight, torch.minimum((1 - t) ** 2, 2.0 * t**2), rtol=1e-6, atol=0)  # gamma 2 by hand
    weighted = flow_matching_loss(velocity, x0, t, eps, weight)
    assert loss.item() == weighted.item()
    assert abs(loss.item() - flow_matching_loss(velocity, x0, t, eps).item()) > 1e-3 * loss.item()


def test_the_dispersive_loss_reads_the_chosen_block_and_adds_at_its_weight(tmp_path):
    """train.dispersive_*: the loss is the plain one plus weight x the dispersive loss of the chosen block's tokens at
    the same draws (the block's output read by a hook on a twin model run by hand); the extras carry both parts; a
    block the expert does not have is refused naming the setting."""
    disp = {"dispersive_weight": 0.5, "dispersive_tau": 0.7, "dispersive_block": 0}
    root, task, model, batch, (loss, extras) = expert_loss(tmp_path, disp)

    plain = build_task(root, synthetic_config(k=2), JobSpec("expert", 0))
    tokens: list[torch.Tensor] = []
    hook = model.blocks[0].register_forward_hook(lambda m, a, out: tokens.append(out))
    regression, _ = plain.loss(model, batch, torch.Generator().manual_seed(3))
    hook.remove()
    assert len(tokens) == 1 and tokens[0].shape[0] == 8  # one forward, the batch's hidden tokens
    expected = dispersive_loss(tokens[0], 0.7)
    assert extras["regression"].item() == regression.item() and extras["dispersive"].item() == expected.item()
    assert loss.item() == pytest.approx((regression + 0.5 * expected).item(), rel=1e-6)
    assert expected.item() < 0  # a real spread, not the all-alike maximum

    depth = task.model_cfg.depth
    bad = synthetic_config(k=2, train={**disp, "dispersive_block": depth})
    with pytest.raises(ParameterError, match=f"train.dispersive_block: {depth} is out of range"):
        build_task(root, bad, JobSpec("expert", 0))


def test_repa_aligns_the_chosen_blocks_tokens_through_the_projector_with_the_prepared_ones(tmp_path):
    """expert.repa_dim with train.repa_*: the loss is the plain one plus repa_weight x the alignment of the chosen
    block's tokens, through the model's projector, with the items' prepared tokens (the block read by a hook, the
    projector run by hand at the same draws); the alignment's gradient reaches the projector; shards whose tokens
    have another width are refused naming both sides."""
    root, task, model, batch, (loss, extras) = expert_loss(tmp_path, {"repa_weight": 0.7, "repa_block": 0}, 6)
    assert batch["repa_tokens"].shape == (8, task.model_cfg.num_tokens, 6)
    tokens: list[torch.Tensor] = []
    hook = model.blocks[0].register_forward_hook(lambda m, a, out: tokens.append(out))
    plain = build_task(root, synthetic_config(k=2), JobSpec("expert", 0))
    regression, _ = plain.loss(model, batch, torch.Generator().manual_seed(3))
    hook.remove()
    expected = alignment_loss(model.repa_projector(tokens[0]), batch["repa_tokens"])
    assert extras["regression"].item() == regression.item() and extras["alignment"].item() == expected.item()
    assert loss.item() == pytest.approx((regression + 0.7 * expected).item(), rel=1e-6)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.repa_projector.parameters())

    raw = load_run_config(root).to_dict()
    raw["expert"]["repa_dim"] = 5  # the prepared tokens are 6 wide
    with pytest.raises(FlowfleetError, match="repa_tokens are 16x6 per item, but .* aligns 16 tokens with repa_dim 5"):
        build_task(root, RunConfig.from_dict(raw), JobSpec("expert", 0))


@pytest.mark.usefixtures("one_thread")
def test_a_repa_job_trains_logs_its_alignment_and_keeps_the_projector_in_its_weights(tmp_path):
    """A job of an expert with a projector trains through the loop: its log has the alignment beside the regression,
    final/ loads as the configured expert (projector included)."""
    import json

    from fixtures import synthetic_run

    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import load_model
    from flowfleet.train.loop import TrainOptions

    raw = synthetic_config(k=2, steps=3, train={"repa_weight": 0.5}).to_dict()
    raw["expert"]["repa_dim"] = 4
    cfg = RunConfig.from_dict(raw)
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, cfg)
    options = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)
    assert synthetic_run.run_job(root, JobSpec("expert", 0), options).state == "done"
    lines = [json.loads(x) for x in (tmp_path / "run/experts/0/metrics.jsonl").read_text().splitlines()]
    assert all(-1 <= x["alignment"] <= 1 and x["regression"] > 0 for x in lines)
    final = load_model(DiTExpert, root, "experts/0", "final")
    assert final.cfg.repa_dim == 4 and final.repa_projector is not None
