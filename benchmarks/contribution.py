"""A stranger's expert on the demo fleet: kit -> contribute -> admit, with the fleet's figures before and after.

Trains the demo's fleet (its full plan: K = 2 caption clusters, 1000 steps per expert, 300 per router; no
monolith) on the built-in digits without 8 and 9 (`flowfleet init/prepare/cluster/train-all/assemble`), writes its
kit, and has a "stranger" (their own key, their own work folder, the kit only) contribute an expert on the 8s and
9s with `flowfleet contribute`, which the owner admits with `flowfleet admit`. The fleet's judge scores (classifier
FD, prompt accuracy, by the built-in digit judge) before and after, on the fleet's own held-out prompts (digits
0-7) and on the contribution's ("eight", "nine"; its held-out items, prepared by the contributor). Then two bad
contributions to the same fleet, each refused with its line: an untrained expert (the honest package's expert
replaced by a fresh one, signed again) and a poisoned one (trained by `contribute` on one digit image under every
caption, its latents sample taken from the fleet's own cluster 0 and signed again).

    .venv/bin/python benchmarks/contribution.py --out runs/bench/contribution
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def scores(model: Path, reference: Path, n: int) -> dict[str, Any]:
    got = evaluate_model(model, reference, n, ("top2",))["top2"]
    return {k: got[k] for k in ("classifier_fd", "accuracy", "per_class", "fid")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/contribution")
    p.add_argument("--n", type=int, default=300, help="samples per evaluation")
    a = p.parse_args()
    out = Path(a.out)
    run, kit, keys = out / "fleet", out / "kit", out / "keys"
    rows: dict[str, Any] = {"seconds": {}}
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
    before_file = out / "before.json"
    if not before_file.exists():
        before = {
            "old": scores(run / "model", out / "reference-old", a.n),
            "new": scores(run / "model", out / "honest.work", a.n),
        }
        before_file.write_text(json.dumps(before))
    rows["before"] = json.loads(before_file.read_text())

    refusals = {}
    for name, pkg in bad.items():  # refused first, so that the fleet is the same one the honest expert joins
        refusals[name] = flowfleet("admit", str(run), str(pkg), "--trusted", str(out / "trusted.pub"), "--no-progress")
        print(f"admit ({name}): {refusals[name]}")
    rows["refusals"] = refusals
    t0 = time.perf_counter()
    done = subprocess.run(
        [*FLOWFLEET, "admit", str(run), str(out / "honest"), "--trusted", str(out / "trusted.pub"), "--no-progress"],
        capture_output=True, text=True,
    )  # fmt: skip
    rows["seconds"]["admit"] = round(time.perf_counter() - t0, 1)
    rows["admit"] = done.stdout.strip().splitlines()
    print("admit (honest):", "\n  ".join(rows["admit"]) or done.stderr.strip().splitlines()[-1])
    rows["after"] = {
        "old": scores(run / "model", out / "reference-old", a.n),
        "new": scores(run / "model", out / "honest.work", a.n),
    }
    for which in ("old", "new"):
        b, f = rows["before"][which], rows["after"][which]
        print(
            f"{which}: classifier FD {b['classifier_fd']:.2f} -> {f['classifier_fd']:.2f}, "
            f"prompt accuracy {b['accuracy']:.3f} -> {f['accuracy']:.3f}"
        )
    (out / "contribution.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
