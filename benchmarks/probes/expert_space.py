"""Which expert architecture buys the most fidelity per CPU-minute on MNIST-5k (pixel space).

Trains one text-conditioned flowfleet DiT for a number of optimiser steps on the first 4000 digits of
the built-in MNIST-5k (the demo's training split) and, at each checkpoint, samples `--n` images for
prompts cycling over the ten digits, over a guidance sweep, and scores them against the held-out 1000
(items 4000..4999, which no training step sees) in the digit classifier's feature space:

    classifier FD   Fréchet distance to the 500 reference digits 4500..4999
    floor           the same FD of `--n` real held-out digits (4000..) that are not in the reference
    precision / recall (k = 3 nearest neighbours, Kynkäänniemi et al. 2019; the `prdc` package)
    prompt accuracy the share of samples the classifier reads as the prompted digit

Training runs on one torch thread (what a train-all job gets on 2 cores); its wall time per step is
printed (compare rows of one run of the script only: the box is shared). Evaluation is not timed.

    python benchmarks/probes/expert_space.py --label p7 --patch 7 --steps 500,1000,2000 --out runs/bench/space
    python benchmarks/probes/expert_space.py --label p4 --patch 4 --steps 500,1000,2000 --out runs/bench/space
    python benchmarks/probes/expert_space.py --label p7-xattn --patch 7 --conditioning cross_attn ...

Prints one JSON line per checkpoint and guidance scale, appends it to OUT/space.jsonl, and writes
OUT/<label>-<steps>.png (the first 40 samples at the best-FD scale).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

TRAIN_ITEMS = 4000  # the demo's training split; the rest of MNIST-5k is held out
REF = slice(4500, 5000)  # the FD reference
FLOOR_START = 4000  # real held-out digits scored like a model, disjoint from REF


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="run")
    p.add_argument("--patch", type=int, default=7)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--conditioning", default="pooled", choices=["pooled", "cross_attn"])
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--digits", default="0,1,2,3,4,5,6,7,8,9", help="train on these digits only (an expert)")
    p.add_argument("--autoencoder", default="", help="a diffusers AutoencoderKL folder: the DiT learns its latents")
    p.add_argument("--items", type=int, default=0, help="train on a random N of the training items (an expert's share)")
    p.add_argument("--steps", default="500,1000,2000", help="checkpoints (optimiser steps)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--sampler", default="euler")
    p.add_argument("--cfg", default="1,2,3,4.5,6,8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/space")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    torch.manual_seed(a.seed)

    from flowfleet.config import TextEncoderConfig
    from flowfleet.data.encoders import build_text_encoder
    from flowfleet.data.sources import DIGIT_WORDS
    from flowfleet.evaluate.digits import DigitJudge, mnist_tensors, train_classifier
    from flowfleet.evaluate.fid import FeatureStats, frechet_distance
    from flowfleet.evaluate.precision_recall import precision_recall
    from flowfleet.evaluate.views import captioned_grid_png
    from flowfleet.flow import cfg_combine, flow_matching_loss, integrate, sample_t, time_grid
    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.flops import train_flops_per_sample
    from flowfleet.train.ema import EMA

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    x_all, y_all = mnist_tensors()
    net, _ = train_classifier(x_all, y_all, progress=False)  # trained on the first 4000 only
    judge = DigitJudge(net, {})
    feats = judge.extractor()

    def features(images: torch.Tensor) -> torch.Tensor:
        return feats(((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8))

    def stats(f: torch.Tensor) -> FeatureStats:
        s = FeatureStats.empty(f.shape[1])
        s.update(f)
        return s

    ref_f = features(x_all[REF])
    ref = stats(ref_f)
    floor_f = features(x_all[FLOOR_START : FLOOR_START + a.n])
    floor = frechet_distance(ref, stats(floor_f))
    floor_pr = precision_recall(ref_f, floor_f)

    digits = [int(d) for d in a.digits.split(",")]
    x_train, y_train = x_all[:TRAIN_ITEMS], y_all[:TRAIN_ITEMS]
    keep = torch.isin(y_train, torch.tensor(digits))
    x0_all, labels = x_train[keep], y_train[keep]
    if a.items:
        pick = torch.randperm(x0_all.shape[0], generator=torch.Generator().manual_seed(a.seed))[: a.items]
        x0_all, labels = x0_all[pick], labels[pick]
    text_len = 16
    enc = build_text_encoder(TextEncoderConfig(name="minilm", max_length=text_len))
    emb = enc.encode([f"a handwritten digit {w}" for w in DIGIT_WORDS])  # per digit

    def cond_of(lab: torch.Tensor) -> dict[str, torch.Tensor]:
        kw = {"text_pooled": emb.pooled[lab]}
        if a.conditioning == "cross_attn":
            kw.update(text_tokens=emb.tokens[lab].float(), text_mask=emb.mask[lab])
        return kw

    shape = (1, 28, 28)
    decode = lambda z: z  # noqa: E731
    if a.autoencoder:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(a.autoencoder).eval()
        pad = (32 - 28) // 2
        with torch.no_grad():
            z = torch.cat(
                [
                    vae.encode(torch.nn.functional.pad(x, (pad,) * 4, value=-1.0)).latent_dist.mean
                    for x in x0_all.split(500)
                ]
            )
        scale = 1.0 / float(z.std())
        x0_all = z * scale
        shape = tuple(x0_all.shape[1:])

        @torch.no_grad()
        def decode(z: torch.Tensor) -> torch.Tensor:
            return vae.decode(z / scale).sample[:, :, pad:-pad, pad:-pad]

    model = DiTExpert(
        input_size=shape[1:],
        in_channels=shape[0],
        patch_size=a.patch,
        hidden_size=a.hidden,
        depth=a.depth,
        num_heads=a.heads,
        conditioning=a.conditioning,
        text_dim=384,
        text_len=text_len if a.conditioning == "cross_attn" else 0,
        add_pooled=a.conditioning == "cross_attn",
    )
    flops = train_flops_per_sample(model.cfg)
    ema = EMA(model, a.ema, warmup=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(a.seed)
    n = a.n
    eval_labels = torch.arange(n) % 10
    eval_noise = torch.randn(n, *shape, generator=torch.Generator().manual_seed(1234))
    prompts = [f"a handwritten digit {DIGIT_WORDS[d]}" for d in eval_labels.tolist()]

    @torch.no_grad()
    def sample(scale: float) -> torch.Tensor:
        m = ema.module.eval()
        c = cond_of(eval_labels)
        both = {k: torch.cat([v, v]) for k, v in c.items()}
        drop = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])

        def vel(x, t, _i):
            vc, vu = m(torch.cat([x, x]), torch.cat([t, t]), drop=drop, **both).chunk(2)
            return cfg_combine(vc, vu, scale)

        return decode(integrate(vel, eval_noise, time_grid(a.sample_steps), sampler=a.sampler)).clamp(-1, 1)

    trained, step = 0.0, 0
    for target in [int(s) for s in a.steps.split(",")]:
        t0 = time.perf_counter()
        model.train()
        while step < target:
            lr = a.lr * min(1.0, (step + 1) / a.warmup) if a.warmup else a.lr
            for g in opt.param_groups:
                g["lr"] = lr
            idx = torch.randint(0, x0_all.shape[0], (a.batch,), generator=gen)
            t = sample_t(a.batch, mode="logit_normal", generator=gen)
            eps = torch.randn(x0_all[idx].shape, generator=gen)
            drop = torch.rand(a.batch, generator=gen) < 0.1
            c = cond_of(labels[idx])
            loss = flow_matching_loss(lambda xt, tt, drop=drop, c=c: model(xt, tt, drop=drop, **c), x0_all[idx], t, eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update(model)
            step += 1
        trained += time.perf_counter() - t0
        best: tuple[float, torch.Tensor] | None = None
        for scale in [float(c) for c in a.cfg.split(",")]:
            images = sample(scale)
            f = features(images)
            fd = frechet_distance(ref, stats(f))
            pr = precision_recall(ref_f, f)
            acc = judge.prompt_accuracy(images, prompts)["accuracy"]
            rec = {
                "label": a.label,
                "steps": step,
                "train_s": round(trained, 1),
                "s_per_step": round(trained / step, 4),
                "train_flops": flops * a.batch * step,
                "cfg": scale,
                "fd": round(fd, 2),
                "floor": round(floor, 2),
                "fd_over_floor": round(fd / floor, 2),
                "precision": round(pr["precision"], 3),
                "recall": round(pr["recall"], 3),
                "floor_precision": round(floor_pr["precision"], 3),
                "floor_recall": round(floor_pr["recall"], 3),
                "accuracy": round(acc, 3),
                "loss": round(float(loss), 4),
                "config": {k: v for k, v in vars(a).items() if k not in ("steps", "cfg", "out")},
            }
            print(json.dumps(rec), flush=True)
            with open(out / "space.jsonl", "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            if acc >= 0.95 and (best is None or fd < best[0]):
                best = (fd, images)
        if best is not None:
            png = captioned_grid_png(best[1][:40], prompts[:40], cols=10, title=f"{a.label} {step} steps")
            (out / f"{a.label}-{step}.png").write_bytes(png)


if __name__ == "__main__":
    main()
