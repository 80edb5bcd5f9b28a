"""The gate's cost under two size bombs, each refused: what `flowfleet admit` spends in time and peak memory.

    weights   a package whose weights file is 1 GiB (sparse: no disk), listed and signed by a trusted key
    manifest  a package whose manifest.json is a link to /dev/zero (no key needed)

On a scratch copy of a run's configuration, model folder and latent space (--run, the digits demo's by default), a
kit is issued and a key trusted; each attack runs `admit` in a fresh process, which reports its wall seconds and its
peak resident memory (getrusage), beside the same process doing everything but the admission (the imports: the
baseline). The bound the gate promises (docs/contributing-experts.md): the copy stops at the kit's cap, so neither
grows with what the package claims.

    .venv/bin/python benchmarks/gate_bounds.py --run runs/demo --out runs/bench/gate-bounds.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch  # noqa: F401 - what every admission imports
from flowfleet.stages.admit import GateSettings, Refused, admit
line = ""
if sys.argv[1] != "baseline":
    try:
        admit(sys.argv[2], sys.argv[3], sys.argv[4], settings=GateSettings(device="cpu", judge=None), progress=False)
        line = "admitted"
    except Refused as err:
        line = str(err)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mib": peak, "refusal": line}))
"""


def scratch_fleet(src: Path, work: Path) -> tuple[Path, Path, Path]:
    """A run root with src's run.yaml, model/ and autoencoder/, a kit issued, alice's key trusted: (run, kit, key)."""
    from flowfleet.sampling.signing import keygen
    from flowfleet.stages.kit import make_kit
    from flowfleet.storage import RunRoot

    shutil.rmtree(work, ignore_errors=True)
    run = work / "run"
    run.mkdir(parents=True)
    shutil.copy(src / "run.yaml", run / "run.yaml")
    for folder in ("model", "autoencoder"):
        if (src / folder).is_dir():
            shutil.copytree(src / folder, run / folder)
    make_kit(RunRoot(str(run)), str(work / "kit"))
    keygen(work / "keys" / "alice")
    (work / "trusted.pub").write_text((work / "keys" / "alice.pub").read_text())
    return run, work / "kit", work / "keys" / "alice.key"


def bomb_packages(work: Path, kit_dir: Path, key: Path, model: Path) -> dict[str, Path]:
    """The two packages: 1 GiB weights (signed under a made-up sha256), and a manifest linked to /dev/zero."""
    from flowfleet.sampling.signing import load_private, sign
    from flowfleet.stages.contribute import MANIFEST_FORMAT
    from flowfleet.stages.kit import read_kit

    kit = read_kit(str(kit_dir))
    weights = work / "weights-bomb"
    (weights / "expert").mkdir(parents=True)
    shutil.copy(model / "expert_0" / "config.json", weights / "expert" / "config.json")
    with open(weights / "expert" / "diffusion_pytorch_model.safetensors", "wb") as f:
        f.truncate(1 << 30)
    config = hashlib.sha256((weights / "expert" / "config.json").read_bytes()).hexdigest()
    files = {"expert/config.json": config, "expert/diffusion_pytorch_model.safetensors": "0" * 64}
    record = {
        "format": MANIFEST_FORMAT,
        "kit": kit.fingerprint,
        "fleet_id": kit.fleet_id,
        "fleet": kit.run_name,
        "time_convention": kit.time_convention,
        "files": files,
        "training": {"steps": 1, "items": 1, "final_loss": 1.0, "objective": "fm"},
    }
    body = json.dumps(record).encode()
    (weights / "manifest.json").write_bytes(body)
    (weights / "manifest.sig").write_bytes(sign(load_private(key), body))
    zero = work / "manifest-bomb"
    zero.mkdir()
    os.symlink("/dev/zero", zero / "manifest.json")
    (zero / "manifest.sig").write_bytes(bytes(64))
    return {"weights": weights, "manifest": zero}


def measure(what: str, run: Path, pkg: Path | None, trusted: Path) -> dict:
    args = [sys.executable, "-c", CHILD, what, str(run), str(pkg or ""), str(trusted)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode:
        raise SystemExit(f"{what}: failed\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a run with model/ (the digits demo's)")
    p.add_argument("--work", default="runs/bench/gate-bounds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    work = Path(a.work).resolve()
    run, kit, key = scratch_fleet(Path(a.run).resolve(), work)
    packages = bomb_packages(work, kit, key, run / "model")
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "runs": {}}
    for what in ("baseline", *packages):
        figures = [measure(what, run, packages.get(what), work / "trusted.pub") for _ in range(a.repeats)]
        best = min(figures, key=lambda f: f["seconds"])
        result["runs"][what] = {
            "seconds": [round(f["seconds"], 2) for f in figures],
            "peak_mib": max(f["peak_mib"] for f in figures),
            "refusal": best["refusal"],
        }
        print(f"{what:<9} {min(f['seconds'] for f in figures):6.2f} s  peak {result['runs'][what]['peak_mib']:7.1f} MiB"
              f"  {best['refusal']}", flush=True)  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
