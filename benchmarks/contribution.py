"""A stranger's expert on the demo fleet: kit -> contribute -> admit, with the fleet's figures before and after.

Trains the demo's fleet (its full plan: K = 4 clusters of image features, 3000 steps per expert shared by size,
4000 router steps; no monolith) on the built-in digits without 8 and 9 (`flowfleet init/prepare/cluster/train-all/
assemble`), writes its kit, and has a "stranger" (their own key, their own work folder, the kit only) contribute an
expert on the 8s and 9s with `flowfleet contribute`. The owner admits it with `flowfleet admit` into two fresh copies
of the fleet: as trained (Paris' prompt-blind router) and with the same experts under a router that also reads the
prompt. The fleet's judge scores (classifier FD, prompt accuracy, by the built-in digit judge; `flowfleet evaluate`,
top-2, `--repeats` draws) before and after, on the fleet's own prompts (digits 0-7, against its held-out images) and
on the contribution's ("eight", "nine"; its held-out items, prepared by the contributor). Before the honest one, two
bad contributions to the same fleet, each refused with its line: an untrained expert (the honest package's expert
replaced by a fresh one, signed again) and a poisoned one (trained by `contribute` on one digit image under every
caption, its latents sample taken from the fleet's own cluster 0 and signed again).

    .venv/bin/python benchmarks/contribution.py --out runs/bench/contribution
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fleet_runs import evaluate_model, without_8_and_9  # benchmarks/fleet_runs.py

FLOWFLEET = [sys.executable, "-m", "flowfleet.cli"]


def flowfleet(*args: str) -> str:
    """A flowfleet command as a user types it; -> its last line of output."""
    done = subprocess.run([*FLOWFLEET, *args], capture_output=True, text=True)
    if done.returncode:
        return (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return (done.stdout.strip().splitlines() or [""])[-1]


def train_fleet(out: Path) -> float:
    """The demo fleet without 8 and 9, trained and assembled (resumes); -> seconds."""
    from flowfleet.config import RunConfig
    from flowfleet.storage import RunRoot

    t0 = time.perf_counter()
    if not (out / "run.yaml").exists():
        RunConfig.from_dict(without_8_and_9("digits-without-8-9")).save(RunRoot(str(out)))
    for stage in (["prepare"], ["cluster"], ["train-all"], ["assemble"]):
        if stage == ["cluster"] and (out / "clusters" / "report.json").exists():
            continue
        print(f"{stage[0]}: {flowfleet(*stage, str(out), *(['--no-progress'] if stage != ['assemble'] else []))}")
    return time.perf_counter() - t0


def one_digit_folder(folder: Path, run: Path) -> None:
    """The poisoner's data: one digit of the fleet's own (its first) under every digit's caption, 300 times."""
    from flowfleet.config import load_run_config
    from flowfleet.data.encoders import run_latent_encoder
    from flowfleet.data.shards import ShardSet
    from flowfleet.sampling.views import to_pil
    from flowfleet.storage import RunRoot

    folder.mkdir(parents=True, exist_ok=True)
    root = RunRoot(str(run))
    latents = ShardSet(root, "data").load(["latents"])["latents"][:1]
    image = to_pil(run_latent_encoder(root, load_run_config(root)).decode(latents.float()))[0].convert("L")
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    rows = []
    for i in range(300):
        image.save(folder / f"{i}.png")
        rows.append({"file": f"{i}.png", "caption": f"a handwritten digit {words[i % 10]}", "label": i % 10})
    (folder / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def resign(pkg: Path, kit: Path, key: Path) -> None:
    from flowfleet.sampling.signing import load_private
    from flowfleet.stages.contribute import sign_package
    from flowfleet.stages.kit import read_kit
    from flowfleet.storage import RunRoot

    training = json.loads((pkg / "manifest.json").read_text())["training"]
    sign_package(RunRoot(str(pkg)), load_private(key), read_kit(str(kit)), training)


def bad_packages(out: Path, run: Path, kit: Path, key: Path, steps: int) -> dict[str, Path]:
    """The untrained and the poisoned packages (built once)."""
    import safetensors.torch

    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import WEIGHTS_NAME, read_dit_config

    untrained = out / "untrained"
    if not untrained.exists():
        shutil.copytree(out / "honest", untrained)
        fresh = DiTExpert.from_dit_config(read_dit_config(str(untrained), "expert"))
        safetensors.torch.save_file(fresh.state_dict(), untrained / "expert" / WEIGHTS_NAME)
        resign(untrained, kit, key)
    poisoned = out / "poisoned"
    if not poisoned.exists():
        one_digit_folder(out / "one-digit", run)
        print(
            "contribute (poisoned):",
            flowfleet("contribute", str(kit), "--data", str(out / "one-digit"), "--out", str(poisoned), "--key",
                      str(key), "--steps", str(steps), "--heldout", "60", "--no-progress"),
        )  # fmt: skip
        shutil.copy2(run / "partitions" / "0" / "shard-00000.safetensors", poisoned / "latents.safetensors")
        resign(poisoned, kit, key)
    return {"untrained": untrained, "poisoned": poisoned}


REFERENCE_PARTS = ("data", "eval", "clusters", "partitions", "autoencoder", "reports/digit_classifier")


def frozen_reference(run: Path, dest: Path) -> None:
    """The fleet as it is now, as evaluate's reference: its run.yaml copied and its data linked. Scored against it
    after an admission, the old prompts are the same prompts with the same noise (evaluate draws them from the
    reference's items, which an admission extends with the contribution's sample)."""
    if (dest / "run.yaml").exists():
        return
    for part in REFERENCE_PARTS:
        (dest / part).parent.mkdir(parents=True, exist_ok=True)
        (dest / part).symlink_to((run / part).resolve(), target_is_directory=True)
    shutil.copy2(run / "run.yaml", dest / "run.yaml")


VARIANTS = {
    "paris": "the run's own router, Paris' prompt-blind p(k | x_t, t)",
    "prompt": "the same experts, a router that also reads the prompt, p(k | x_t, t, prompt)",
}


def variant_fleet(out: Path, run: Path, variant: str) -> Path:
    """A fresh copy of the fleet to admit into, out/grown-<variant>/: as trained ("paris"), or ("prompt") with its
    router trained again reading the prompt (run.yaml router.conditioning pooled; the experts unchanged)."""
    from flowfleet.config import RunConfig, load_run_config
    from flowfleet.storage import RunRoot

    dest = out / f"grown-{variant}"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    if variant == "prompt":
        root = RunRoot(str(dest))
        raw = load_run_config(root).to_dict()
        raw["router"].update(conditioning="pooled", text_dim=raw["expert"]["text_dim"])
        RunConfig.from_dict(raw).save(root)
        for folder in ("router", "model"):
            shutil.rmtree(dest / folder)
        print(f"train-router ({variant}): {flowfleet('train-router', str(dest), '--no-progress')}")
        print(f"assemble ({variant}): {flowfleet('assemble', str(dest))}")
    return dest


def scores(model: Path, reference: Path, n: int, repeats: int) -> dict[str, Any]:
    """The judge's figures of the model's default strategy (top-2) on the reference's prompts: draw 0 in full (with
    Inception FID and the real floor), and every draw's classifier FD and prompt accuracy (seeds 0 .. repeats - 1)."""
    got = evaluate_model(model, reference, n, ("top2",), repeats=repeats)["top2"]
    out = {k: got[k] for k in ("classifier_fd", "accuracy", "per_class", "fid")}
    out["floor_classifier_fd"] = got["floor"].get("classifier_fd")
    if "draws" in got:
        for key in ("classifier_fd", "prompt_accuracy"):
            values = got["draws"][key]
            out[f"{key}_draws"] = values
            out[f"{key}_mean"], out[f"{key}_sd"] = statistics.mean(values), statistics.stdev(values)
        out["floor_classifier_fd_draws"] = got["draws"]["floor"].get("classifier_fd")
    return out


def admit_variant(out: Path, run: Path, variant: str, bad: dict[str, Path], n: int, repeats: int) -> dict[str, Any]:
    """On a fresh copy of the fleet (variant_fleet): the bad packages refused, the honest one admitted (or refused),
    the judge's figures before and after on the old prompts and on the contribution's; the gate's picture of its
    judged samples in out/honest-<variant>.png."""
    fleet = variant_fleet(out, run, variant)
    row: dict[str, Any] = {"router": VARIANTS[variant], "seconds": {}}
    refs = {"old": out / "reference-old", "new": out / "honest.work"}
    row["before"] = {which: scores(fleet / "model", ref, n, repeats) for which, ref in refs.items()}
    row["refusals"] = {}
    for name, pkg in bad.items():  # refused first, so that the fleet is the same one the honest expert joins
        row["refusals"][name] = flowfleet("admit", str(fleet), str(pkg), "--trusted", str(out / "trusted.pub"))
        print(f"admit ({variant}, {name}): {row['refusals'][name]}")
    t0 = time.perf_counter()
    done = subprocess.run(
        [*FLOWFLEET, "admit", str(fleet), str(out / "honest"), "--trusted", str(out / "trusted.pub"), "--no-progress",
         "--picture", str(out / f"honest-{variant}.png")],
        capture_output=True, text=True,
    )  # fmt: skip
    row["seconds"]["admit"] = round(time.perf_counter() - t0, 1)
    row["admitted"] = done.returncode == 0
    row["admit"] = done.stdout.strip().splitlines() if row["admitted"] else done.stderr.strip().splitlines()[-1:]
    print(f"admit ({variant}, honest):", "\n  ".join(row["admit"]))
    if row["admitted"]:
        row["after"] = {which: scores(fleet / "model", ref, n, repeats) for which, ref in refs.items()}
        for which in ("old", "new"):
            b, f = row["before"][which], row["after"][which]
            print(
                f"{variant} {which}: classifier FD {b['classifier_fd_mean']:.2f} -> {f['classifier_fd_mean']:.2f}, "
                f"prompt accuracy {b['prompt_accuracy_mean']:.3f} -> {f['prompt_accuracy_mean']:.3f} "
                f"(means of {repeats} draws)"
            )
    return row


def null_change(out: Path, run: Path, n: int, repeats: int) -> dict[str, Any]:
    """How far the gate's judged figures move when nothing is contributed: the fleet against itself with its router
    trained again from another seed (out/null-router/), on the gate's draw of the fleet's held-out prompts (admit's
    JudgedDraw, seeds 0 .. repeats - 1). -> per seed: accuracy and classifier FD of both, and their differences."""
    from flowfleet.config import RunConfig, load_run_config
    from flowfleet.sampling.pipeline import FleetPipeline
    from flowfleet.stages.evaluate import EvaluateOptions, JudgedDraw
    from flowfleet.storage import RunRoot

    other = out / "null-router"
    if not (other / "model").exists():
        shutil.rmtree(other, ignore_errors=True)
        shutil.copytree(run, other, ignore=shutil.ignore_patterns("checkpoints", "tb", "router", "model"))
        raw = load_run_config(RunRoot(str(other))).to_dict()
        raw["router_train"]["seed"] += 1
        RunConfig.from_dict(raw).save(RunRoot(str(other)))
        print(f"train-router (null): {flowfleet('train-router', str(other), '--no-progress')}")
        print(f"assemble (null): {flowfleet('assemble', str(other))}")
    fleets = {name: FleetPipeline.from_pretrained(str(where / "model"), device="cpu") for name, where in
              (("fleet", run), ("router reseeded", other))}  # fmt: skip
    rows = []
    for seed in range(repeats):
        draw = JudgedDraw.open(str(run), EvaluateOptions(n=n, seed=seed, diagnostics=False, device="cpu"), "pooled",
                               held_out=True)  # fmt: skip
        assert draw is not None
        got = {name: draw.score(pipe, name=name, progress=False) for name, pipe in fleets.items()}
        a, b = got["fleet"], got["router reseeded"]
        rows.append({
            "seed": seed,
            "accuracy": [a["prompt_accuracy"], b["prompt_accuracy"]],
            "classifier_fd": [a["classifier_fd"], b["classifier_fd"]],
            "accuracy_change": b["prompt_accuracy"] - a["prompt_accuracy"],
            "fd_change": b["classifier_fd"] / a["classifier_fd"] - 1,
        })  # fmt: skip
        print(f"null (seed {seed}): accuracy {a['prompt_accuracy']:.3f} -> {b['prompt_accuracy']:.3f}, classifier FD "
              f"{a['classifier_fd']:.2f} -> {b['classifier_fd']:.2f} ({rows[-1]['fd_change']:+.1%})")  # fmt: skip
    return {"draws": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/contribution")
    p.add_argument("--n", type=int, default=300, help="samples per evaluation")
    p.add_argument("--repeats", type=int, default=3, help="evaluation draws (seeds 0 .. repeats - 1)")
    p.add_argument("--variants", default="paris,prompt", help="the fleet's routers to admit into (paris, prompt)")
    p.add_argument(
        "--parts",
        default="variants,null",
        help="what to run: variants (the admissions), null (the judged figures' movement with nothing contributed); "
        "each part's results (each variant's) replace its own",
    )
    a = p.parse_args()
    out = Path(a.out)
    run, kit, keys = out / "fleet", out / "kit", out / "keys"
    rows: dict[str, Any] = json.loads(results.read_text()) if (results := out / "contribution.json").exists() else {}
    rows.setdefault("seconds", {})
    rows["seconds"]["fleet"] = round(train_fleet(run), 1)

    from flowfleet.config import load_run_config
    from flowfleet.storage import RunRoot

    steps = load_run_config(RunRoot(str(run))).train.steps
    if not kit.exists():
        print("kit:", flowfleet("kit", str(run), str(kit)))
        print("keygen:", flowfleet("keygen", str(keys / "stranger")))
        (out / "trusted.pub").write_text((keys / "stranger.pub").read_text())
    t0 = time.perf_counter()
    if not (out / "honest" / "manifest.sig").exists():
        print(
            "contribute:",
            flowfleet("contribute", str(kit), "--source", "mnist", "--labels", "8,9", "--out", str(out / "honest"),
                      "--key", str(keys / "stranger.key"), "--steps", str(steps), "--heldout", "1000", "--no-progress"),
        )  # fmt: skip
    rows["seconds"]["contribute"] = round(time.perf_counter() - t0, 1)
    bad = bad_packages(out, run, kit, keys / "stranger.key", steps)
    frozen_reference(run, out / "reference-old")
    parts = a.parts.split(",")
    if "variants" in parts:
        for v in a.variants.split(","):
            rows.setdefault("variants", {})[v] = admit_variant(out, run, v, bad, a.n, a.repeats)
    if "null" in parts:
        rows["null"] = null_change(out, run, a.n, a.repeats)
    results.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
