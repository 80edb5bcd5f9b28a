"""The training recipe's options reach an expert's loss: the time sampler's parameters, the weighting over t, the
dispersive regulariser."""

from __future__ import annotations

import pytest
import torch
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.errors import ParameterError
from flowfleet.flow import dispersive_loss, flow_matching_loss, loss_weight
from flowfleet.storage import RunRoot
from flowfleet.train import preview
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import build_task

RECIPE = {"time_sampling": "logit_normal", "time_mean": 0.8, "time_std": 0.5, "loss_weighting": "min_snr"}


def expert_loss(tmp_path, train: dict):
    """Expert 0's task of a small run with these train settings, a fresh model (seed 0), eight items, and its loss at
    generator seed 3: (root, task, model, batch, (loss, extras))."""
    cfg = synthetic_config(k=2, train=train)
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
