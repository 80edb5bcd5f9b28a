"""How close can any model in a run-trained latent space come to real images? The autoencoder's reconstructions
of the held-out floor images, scored exactly like a model's samples (classifier FD, precision and recall in
the run's judge's features, the digits' or the emoji's, against the same held-out reference as `flowfleet
evaluate`): a DiT that matched the latent distribution perfectly would still be decoded by this decoder.

For each autoencoder recipe (AutoencoderConfig fields as KEY=VALUE, comma-separated; the rest as the run's), trains
it on the run's training images (the first 4000 of MNIST-5k, or the emoji set's training part, as prepare does)
and scores its reconstructions of the floor set, beside the real floor itself:

    python benchmarks/autoencoder_ceiling.py --run runs/demo steps=400 steps=800 steps=800,batch_size=64 steps=1600

    python benchmarks/autoencoder_ceiling.py --run runs/demo-emoji latent_channels=4,batch_size=32,lr=2e-3 \
        latent_channels=8,batch_size=32,lr=2e-3 latent_channels=8,batch_size=16,lr=4e-3

--run: an evaluated demo run (its eval/ split, its judge).
"""

from __future__ import annotations

import argparse
import time


def training_images(cfg):
    """The run's training images in [-1, 1], as prepare reads them: the emoji set's training part, or the
    digits' (the first 4000 of MNIST-5k)."""
    if cfg.data.source == "emoji":
        from flowfleet.data.sources.emoji import load_emoji
        from flowfleet.evaluate.emoji import set_tensors

        emoji = load_emoji()
        return set_tensors(emoji)[0][: emoji.train_stop]
    from flowfleet.evaluate.digits import mnist_tensors

    return mnist_tensors()[0][: 5000 - cfg.data.holdout]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("recipes", nargs="+", help="KEY=VALUE[,KEY=VALUE...] of the autoencoder section")
    a = p.parse_args()

    import torch
    import yaml

    from flowfleet.config import AutoencoderConfig, load_run_config
    from flowfleet.data.autoencoder import crop, pad, train_autoencoder
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.stages.evaluate import EvaluateOptions
    from flowfleet.stages.evaluate.stage import _Evaluation  # the evaluation's own split and judge
    from flowfleet.storage import RunRoot

    torch.set_num_threads(a.threads)
    cfg = load_run_config(RunRoot(a.run))
    base = cfg.encoders.latent.autoencoder.model_dump()
    train = training_images(cfg)
    options = EvaluateOptions(n=300, batch_size=300, fid=FIDSettings(resize=75), diagnostics=False, device="cpu")
    ev = _Evaluation.open(f"{a.run}/model", a.run, options, None)
    floor = ev.ref_images[ev.split.floor].float() / 127.5 - 1.0  # [n, C, S, S] the real held-out images
    judge = ev.judge_fd[0]
    rows = [("real floor", None, ev._judge_scores(judge.features(floor)))]
    for recipe in a.recipes:
        fields = dict(base)
        for part in recipe.split(","):
            key, _, value = part.partition("=")
            fields[key] = yaml.safe_load(value)
        t0 = time.perf_counter()
        vae = train_autoencoder(train, AutoencoderConfig(**fields), progress=False)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            z = vae.encode(pad(floor, vae.config.sample_size)).latent_dist.mean
            recon = crop(vae.decode(z).sample, floor.shape[-1]).clamp(-1, 1)
        rows.append((recipe, seconds, ev._judge_scores(judge.features(recon))))
    print(f"\n{ev.split.floor.numel()} held-out images against {ev.ref_n} reference images, {a.threads} threads")
    print("| autoencoder | train s | classifier FD | precision | recall |")
    print("|---|---|---|---|---|")
    for name, seconds, s in rows:
        sec = f"{seconds:.0f}" if seconds is not None else ""
        print(f"| {name} | {sec} | {s['classifier_fd']:.2f} | {s['precision']:.3f} | {s['recall']:.3f} |")


if __name__ == "__main__":
    main()
