"""A projection, not a measurement: what each way of using K machines that share no fast network costs in wall time
at Paris' scale (the paris-xl2 preset: 8 experts of DiT-XL/2 with cross-attention, 256 px, batch 256), from the cost
terms the small tables measure and public GPU figures.

The terms, per machine (one expert's job, a DiLoCo worker, or a rank of full sync):

    compute   a step of batch B on a machine of G GPUs: B x the model's training FLOPs per sample (flowfleet's exact
              count) / (G x the GPU's data-sheet dense bf16 peak x an assumed MFU)
    full sync a ring all-reduce of fp32 gradients every step, 2 (K - 1) / K x 4 |θ| bytes sent and as many received,
              overlapped with the backward pass, so a step takes the longer of its compute and its traffic; at the
              monolith's global batch B (machines.py's and decision.py's convention: each rank computes B / K a
              step, K times the steps) and at a global batch of K x B (each rank B a step: another recipe)
    DiLoCo    a round every H steps of batch B per worker: its pseudo-gradient up, 4 |θ| bytes, and the K - 1 others'
              down through the bucket, (K - 1) x 4 |θ| (as the small runs' workers counted: status.json's
              bytes_written, bytes_read), plus one round trip; flowfleet's rounds do not overlap compute
    the fleet nothing exchanged; its router (the preset's) is planned as `flowfleet plan` balances it: first on one
              machine, its work shared with the experts' so that every machine ends together

Each option's wall time is shown ÷ its compute alone, at link speeds from 0.1 to 100 Gbit/s (full-duplex, the larger
direction counted). For machines of different speeds (--mix), the share of the machines' capacity each option uses by
one deadline follows from the speeds alone: a synchronous option runs at the slowest's pace.

    python benchmarks/paris_projection.py
    python benchmarks/paris_projection.py --gpu H100 --gpus 8 --mfu 0.4 --links 0.1,1,10,100 --H 10,100,500
    python benchmarks/paris_projection.py --mix A40,A40,A40,A40,A100,A100,H100,H100
"""

from __future__ import annotations

import argparse

from decision import GBIT, ring_bytes  # benchmarks/ is the script's folder

from flowfleet.device import GPU_PEAK_TFLOPS
from flowfleet.models.flops import parameter_count, train_flops_per_sample
from flowfleet.presets import preset
from flowfleet.train.plan import TERA
from flowfleet.train.specs import job_cost, router_spec


def peak(gpu: str) -> float:
    if gpu not in GPU_PEAK_TFLOPS:
        raise SystemExit(f"--gpu {gpu}: not a listed GPU (expected one of {', '.join(GPU_PEAK_TFLOPS)})")
    return GPU_PEAK_TFLOPS[gpu][0] * TERA  # bf16, dense


def projection(a: argparse.Namespace) -> str:
    cfg = preset(a.preset)
    k, batch = cfg.num_experts, cfg.train.batch_size
    params = parameter_count(cfg.expert)
    step_s = batch * train_flops_per_sample(cfg.expert) / (a.gpus * peak(a.gpu) * a.mfu)
    # the router's training over one expert's, at the preset's steps (a share, so the total budget cancels)
    router_share = job_cost(cfg, router_spec(cfg)) / (cfg.train.steps * batch * train_flops_per_sample(cfg.expert))
    links = [float(x) for x in a.links.split(",")]
    sync_bytes = ring_bytes(params, k, 1)  # a step's, each way

    def sync(gbit: float, per_rank: float) -> float:  # per_rank: the share of a step of batch B each rank computes
        return max(per_rank * step_s, sync_bytes / (gbit * GBIT)) / (per_rank * step_s)

    def diloco(h: int, gbit: float) -> float:
        down = (k - 1) * 4 * params  # the larger direction: the others' pseudo-gradients
        return (h * step_s + down / (gbit * GBIT) + a.rtt) / (h * step_s)

    head = " | ".join(f"{g:g} Gbit/s" for g in links)
    out = [
        f"Projection: {a.preset}, K = {k} machines of {a.gpus} × {a.gpu} (bf16 peak {peak(a.gpu) / TERA:g} TFLOP/s, "
        f"MFU {a.mfu:g} assumed), |θ| = {params:,} per expert, a step of batch {batch}: {step_s:.3f} s of compute.",
        "",
        f"| option: wall time ÷ compute | traffic per machine | {head} |",
        "|---|---|" + "---|" * len(links),
        f"| the fleet: {k} experts and the router, planned on {k} machines | 0 | "
        + " | ".join(f"{1 + router_share / k:.3f}" for _ in links)
        + " |",
    ]
    for h in (int(x) for x in a.H.split(",")):
        traffic = f"{4 * params / 2**30:.2f} GiB up, {(k - 1) * 4 * params / 2**30:.1f} GiB down a round"
        out.append(f"| DiLoCo, H = {h} | {traffic} | " + " | ".join(f"{diloco(h, g):.2f}" for g in links) + " |")
    for label, per_rank in ((f"global batch {batch}, each rank {batch // k}", 1 / k), (f"global batch {k * batch}", 1)):
        out.append(
            f"| full sync (DDP, overlapped), {label} | {sync_bytes / 2**30:.2f} GiB each way a step | "
            + " | ".join(f"{sync(g, per_rank):.2f}" for g in links)
            + " |"
        )
    hides = sync_bytes * 8 / (step_s / k) / 1e9
    days = cfg.train.steps * step_s / 86400
    out += [
        "",
        f"Full sync's traffic hides behind compute on a link of {hides:,.0f} Gbit/s or faster at the monolith's batch "
        f"({hides / k:,.0f} at {k} times it); DiLoCo's at H adds "
        f"{(k - 1) * 4 * params * 8 / 1e9:,.1f} Gbit ÷ the link's rate + one round trip ({a.rtt:g} s) every H steps "
        f"(through a bucket; workers that all-reduce their pseudo-gradients instead would each receive "
        f"{ring_bytes(params, k, 1) / 2**30:.2f} GiB a round). The preset's {cfg.train.steps:,} steps an expert: "
        f"{days:.1f} days of compute on one machine, {k * a.gpus * days:,.0f} {a.gpu} GPU-days for the {k} experts.",
    ]
    if a.mix:
        speeds = [peak(g) for g in a.mix.split(",")]
        sync_use = len(speeds) * min(speeds) / sum(speeds)
        out += [
            "",
            f"Machines of different speeds ({a.mix}; {a.gpus} GPUs each), one deadline: the share of their "
            "capacity each option uses (compute only, before traffic): full sync and DiLoCo waiting for the slowest "
            f"{sync_use:.2f}; the fastest alone {max(speeds) / sum(speeds):.2f}; DiLoCo at each machine's pace and "
            "the fleet planned to the deadline 1.00.",
        ]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="paris-xl2")
    p.add_argument("--gpu", default="A40", help="the GPU of every machine (Paris trained on A40s)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in a machine (one expert's job)")
    p.add_argument("--mfu", type=float, default=0.4, help="the share of the peak a step reaches (an assumption)")
    p.add_argument("--links", default="0.1,1,10,100", help="link speeds between machines, Gbit/s")
    p.add_argument("--H", default="10,100,500", help="DiLoCo's steps a round")
    p.add_argument("--rtt", type=float, default=0.1, help="a round trip to the bucket, seconds")
    p.add_argument("--mix", default="", help="GPUs of machines of different speeds, comma-separated")
    print(projection(p.parse_args()))


if __name__ == "__main__":
    main()
