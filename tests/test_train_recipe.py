"""The training recipe's options reach an expert's loss: the time sampler's parameters and the weighting over t."""

from __future__ import annotations

import torch
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.flow import flow_matching_loss, loss_weight
from flowfleet.storage import RunRoot
from flowfleet.train import preview
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import build_task

RECIPE = {"time_sampling": "logit_normal", "time_mean": 0.8, "time_std": 0.5, "loss_weighting": "min_snr"}


def test_an_experts_loss_draws_t_by_its_sampler_and_weights_it(tmp_path):
    """FlowTask.loss under train.time_* and loss_weighting: the replayed draws (t by the job's sampler, the noise, the
    condition dropout) give the Min-SNR-weighted flow-matching loss, which differs from the plain one."""
    cfg = synthetic_config(k=2, train={**RECIPE, "min_snr_gamma": 2.0})
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, cfg, per_cluster=[12, 10], shard_size=6)
    task = build_task(root, cfg, JobSpec("expert", 0))
    torch.manual_seed(0)
    model = task.build_model()
    batch = task.data.gather(torch.arange(8))
    loss, _ = task.loss(model, batch, torch.Generator().manual_seed(3))

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
