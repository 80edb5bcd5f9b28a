"""Sweep of the mnist preset's training recipe: prompt accuracy against training wall time.

Trains one text-conditioned flowfleet DiT on the built-in MNIST-5k (pixel space, MiniLM captions
"a handwritten digit seven") with flowfleet's own model, flow-matching loss, time sampling and EMA,
and at each checkpoint time samples `--n` images (prompts cycling over the digits it was trained on,
fixed noise) and reads them with the run-independent digit classifier (flowfleet.evaluate.digits).
Evaluation time is not counted in the training time.

    # the monolith's recipe, one torch thread (what a train-all job gets on 2 cores), 4 checkpoints
    python benchmarks/probes/mnist_recipe.py --seconds 60,120,240,480 --out runs/bench/recipe
    # an expert: 1/4 of the digits at 1/4 of the time
    python benchmarks/probes/mnist_recipe.py --digits 0,6,8 --seconds 30,60,120 --label expert

Prints one JSON line per checkpoint and appends it to OUT/recipe.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="run")
    p.add_argument("--size", type=int, default=28)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp-ratio", type=float, default=4.0)
    p.add_argument("--conditioning", default="pooled", choices=["pooled", "cross_attn", "class"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--time-sampling", default="logit_normal", choices=["uniform", "logit_normal"])
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--cond-dropout", type=float, default=0.1)
    p.add_argument("--digits", default="0,1,2,3,4,5,6,7,8,9")
    p.add_argument("--seconds", default="60,120,240")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg", default="1.5,3,5")
    p.add_argument("--sampler", default="euler")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default="runs/bench/recipe")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", a.threads)))
    torch.manual_seed(a.seed)

    from flowfleet.config import TextEncoderConfig
    from flowfleet.data.encoders import build_text_encoder
    from flowfleet.data.images import resize_batch
    from flowfleet.data.sources import DIGIT_WORDS
    from flowfleet.evaluate.digits import DigitJudge, mnist_tensors, train_classifier
    from flowfleet.flow import cfg_combine, flow_matching_loss, integrate, sample_t, time_grid
    from flowfleet.models.dit import DiTExpert
    from flowfleet.train.ema import EMA

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    judge_file = out / "judge.pt"
    x_all, y_all = mnist_tensors()
    if judge_file.exists():
        from flowfleet.evaluate.digits import DigitNet

        net = DigitNet()
        net.load_state_dict(torch.load(judge_file))
        judge = DigitJudge(net, {"val_accuracy": float("nan")})
    else:
        net, rec = train_classifier(x_all, y_all, progress=False)
        torch.save(net.state_dict(), judge_file)
        judge = DigitJudge(net, rec)

    digits = [int(d) for d in a.digits.split(",")]
    keep = torch.isin(y_all, torch.tensor(digits))
    x0_all = resize_batch(x_all[keep], a.size) if a.size != 28 else x_all[keep]  # [N, 1, S, S]
    labels = y_all[keep]
    text_len = 16
    enc = build_text_encoder(TextEncoderConfig(name="minilm", max_length=text_len))
    emb = enc.encode([f"a handwritten digit {w}" for w in DIGIT_WORDS])  # per digit

    def cond_of(lab: torch.Tensor) -> dict[str, torch.Tensor]:
        if a.conditioning == "class":
            return {"labels": lab}
        kw = {"text_pooled": emb.pooled[lab]}
        if a.conditioning == "cross_attn":
            kw.update(text_tokens=emb.tokens[lab], text_mask=emb.mask[lab])
        return kw

    model = DiTExpert(
        input_size=(a.size, a.size),
        in_channels=1,
        patch_size=a.patch,
        hidden_size=a.hidden,
        depth=a.depth,
        num_heads=a.heads,
        mlp_ratio=a.mlp_ratio,
        conditioning=a.conditioning,
        num_classes=10 if a.conditioning == "class" else 0,
        text_dim=384,
        text_len=text_len if a.conditioning == "cross_attn" else 0,
        add_pooled=a.conditioning == "cross_attn",
        cond_dropout=a.cond_dropout,
    )
    ema = EMA(model, a.ema, warmup=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator().manual_seed(a.seed)
    checkpoints = [float(s) for s in a.seconds.split(",")]
    cfgs = [float(c) for c in a.cfg.split(",")]
    n = a.n
    eval_labels = torch.tensor([digits[i % len(digits)] for i in range(n)])
    eval_noise = torch.randn(n, 1, a.size, a.size, generator=torch.Generator().manual_seed(1234))
    prompts = [f"a handwritten digit {DIGIT_WORDS[d]}" for d in eval_labels.tolist()]

    @torch.no_grad()
    def evaluate(cfg_scale: float) -> dict:
        m = ema.module.eval()
        c = cond_of(eval_labels)
        both = {k: torch.cat([v, v]) for k, v in c.items()}
        drop = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])

        def vel(x, t, _i):
            vc, vu = m(torch.cat([x, x]), torch.cat([t, t]), drop=drop, **both).chunk(2)
            return cfg_combine(vc, vu, cfg_scale)

        imgs = integrate(vel, eval_noise, time_grid(a.steps), sampler=a.sampler).clamp(-1, 1)
        return judge.prompt_accuracy(imgs, prompts)

    trained, step, samples = 0.0, 0, 0
    for target in checkpoints:
        t0 = time.perf_counter()
        model.train()
        while trained + (time.perf_counter() - t0) < target:
            idx = torch.randint(0, x0_all.shape[0], (a.batch,), generator=gen)
            x0 = x0_all[idx]
            t = sample_t(a.batch, mode=a.time_sampling, generator=gen)
            eps = torch.randn(x0.shape, generator=gen)
            drop = torch.rand(a.batch, generator=gen) < a.cond_dropout
            c = cond_of(labels[idx])
            loss = flow_matching_loss(lambda xt, tt, drop=drop, c=c: fwd(xt, tt, drop=drop, **c), x0, t, eps)
            if a.warmup:
                for g in opt.param_groups:
                    g["lr"] = a.lr * min(1.0, (step + 1) / a.warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update(model)
            step += 1
            samples += a.batch
        trained += time.perf_counter() - t0
        for cs in cfgs:
            t1 = time.perf_counter()
            r = evaluate(cs)
            rec = {
                "label": a.label,
                "seconds": round(trained, 1),
                "steps": step,
                "samples": samples,
                "samples_per_s": round(samples / trained, 1),
                "loss": round(float(loss), 4),
                "cfg": cs,
                "accuracy": round(r["accuracy"], 3),
                "confidence": round(r["confidence"], 3),
                "eval_s": round(time.perf_counter() - t1, 1),
                "config": {k: v for k, v in vars(a).items() if k not in ("seconds", "cfg", "out")},
            }
            print(json.dumps(rec), flush=True)
            with open(out / "recipe.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
