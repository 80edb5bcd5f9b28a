"""How close can any model in a run-trained latent space come to real images? The autoencoder's reconstructions
of held-out images: their mean squared error (pixels in [-1, 1]), and their scores exactly as a model's samples
are scored (classifier FD, precision and recall in the run's judge's features, the digits' or the emoji's, against
the held-out reference `flowfleet evaluate` uses), and the judge's prompt accuracy of every image of the split
reconstructed, its own caption the prompt: a DiT that matched the latent distribution perfectly would still be
decoded by this decoder, so neither figure of a model's samples can be better than its reconstructions' by much.

For each autoencoder recipe (AutoencoderConfig fields as KEY=VALUE, comma-separated; the rest as the run's), trains
it on the run's own training images (the first encoders.latent.autoencoder.train_items of them, as prepare reads
them) and scores its reconstructions of the split's floor images, beside that real floor itself. The choice of a
recipe reads the validation split (the default); --split test gives the figure a report states.

    python benchmarks/autoencoder_ceiling.py --run runs/demo steps=800 steps=400,lr=4e-3 steps=400
    python benchmarks/autoencoder_ceiling.py --run runs/demo-emoji steps=800 steps=400,lr=8e-3

--run: an evaluated demo run (its eval/ split, its judge, its model/ folder).
"""

from __future__ import annotations

import argparse
import re
import time


def training_images(cfg):
    """The run's autoencoder training images [N, C, S, S] in [-1, 1], as prepare reads them (never eval/'s)."""
    from flowfleet.data.sources import build_source
    from flowfleet.stages.prepare import _Split, autoencoder_images

    source = build_source(cfg.data, cfg.storage.options)
    return autoencoder_images(cfg, source, _Split.of(cfg, source))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--split", default="validation", choices=["validation", "test"])
    p.add_argument("recipes", nargs="+", help="KEY=VALUE[,KEY=VALUE...] of the autoencoder section")
    a = p.parse_args()

    import torch

    from flowfleet.config import AutoencoderConfig, load_run_config, set_dotted
    from flowfleet.data.autoencoder import crop, pad, train_autoencoder
    from flowfleet.stages.evaluate import EvaluateOptions
    from flowfleet.stages.evaluate.draw import EvaluationDraw
    from flowfleet.storage import RunRoot

    torch.set_num_threads(a.threads)
    cfg = load_run_config(RunRoot(a.run))
    base = cfg.encoders.latent.autoencoder.model_dump()
    train = training_images(cfg)
    options = EvaluateOptions(n=300, batch_size=300, diagnostics=False, device="cpu")
    ev = EvaluationDraw.open(f"{a.run}/model", a.run, options, None, inception=False, split=a.split)
    if ev.ref_images is None or ev.judge_fd is None:
        raise SystemExit(f"{a.run}: its held-out images or its judge's features are missing")
    floor = ev.ref_images[ev.split.floor].float() / 127.5 - 1.0  # [n, C, S, S] the real held-out images
    judge = ev.judge_fd[0]
    # the prompt accuracy's images: the whole split (the floor is half of it), each with its own caption
    items = ev.splits.items(a.split)
    if items is None:
        raise SystemExit(f"{a.run}: no {a.split} split (data.validation)")
    split_images = ev.ref_images[items].float() / 127.5 - 1.0
    every_caption = ev.ref_data.load([], with_captions=True)[1]
    captions = [every_caption[i] for i in items.tolist()]

    def accuracy(images: torch.Tensor) -> float:
        return float(ev.judge.prompt_accuracy(images, captions)["accuracy"])

    def reconstruct(vae, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = vae.encode(pad(images, vae.config.sample_size)).latent_dist.mean
            return crop(vae.decode(z).sample, images.shape[-1]).clamp(-1, 1)

    rows = [("real floor", None, None, ev._judge_scores(judge.features(floor)), accuracy(split_images))]
    for recipe in a.recipes:
        fields = dict(base)
        for part in re.split(r",(?=\w+=)", recipe):  # a comma before KEY= parts them: a list's own commas stay
            set_dotted(fields, part)
        t0 = time.perf_counter()
        vae = train_autoencoder(train, AutoencoderConfig(**fields), progress=False, threads=a.threads)
        seconds = time.perf_counter() - t0
        recon = reconstruct(vae, floor)
        mse = float(torch.nn.functional.mse_loss(recon, floor))
        rows.append(
            (recipe, seconds, mse, ev._judge_scores(judge.features(recon)), accuracy(reconstruct(vae, split_images)))
        )
        print(
            recipe, f"{seconds:.0f} s", f"MSE {mse:.5f}", rows[-1][3], f"prompt accuracy {rows[-1][4]:.3f}", flush=True
        )
    print(
        f"\n{a.split} split: {ev.split.floor.numel()} held-out images against {ev.ref_n} reference images, "
        f"{train.shape[0]} training images, {a.threads} threads; prompt accuracy over the split's {len(items)}"
    )
    print("| autoencoder | train s | reconstruction MSE | classifier FD | precision | recall | prompt accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds, mse, s, acc in rows:
        sec = f"{seconds:.0f}" if seconds is not None else ""
        err = f"{mse:.5f}" if mse is not None else ""
        print(
            f"| {name} | {sec} | {err} | {s['classifier_fd']:.2f} | {s['precision']:.3f} | {s['recall']:.3f} "
            f"| {acc:.3f} |"
        )


if __name__ == "__main__":
    main()
