"""Verified weights: assemble writes SHA256SUMS, opening a folder checks it, a flipped byte is a one-line
error naming the expert (generate exits 1, serve refuses to start, `flowfleet verify` says which file)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from flowfleet.cli import main
from flowfleet.sampling import folder as model_folder
from flowfleet.sampling.folder import CorruptWeights, verify_weights
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")

EXPERT_1 = "expert_1/diffusion_pytorch_model.safetensors"


def flip_a_byte(path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_assemble_records_every_weight_file_in_sha256sums_format(model_dir, capsys):
    lines = (model_dir / "SHA256SUMS").read_text().splitlines()
    listed = dict(reversed(line.split("  ", 1)) for line in lines)
    weights = sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*.safetensors"))
    assert sorted(listed) == weights and EXPERT_1 in listed and "router/diffusion_pytorch_model.safetensors" in listed
    for rel, sha in listed.items():  # what `sha256sum -c SHA256SUMS` checks
        assert hashlib.sha256((model_dir / rel).read_bytes()).hexdigest() == sha
    assert main(["verify", str(model_dir)]) == 0
    assert f"{len(weights)} weight files match SHA256SUMS" in capsys.readouterr().out


def test_a_flipped_byte_in_an_expert_is_a_one_line_error_naming_it(model_dir, capsys):
    pipe = FleetPipeline.from_pretrained(str(model_dir))  # opens: verified, remembered
    assert pipe.num_experts == 3 and (model_dir / ".verified.json").exists()
    flip_a_byte(model_dir / EXPERT_1)
    with pytest.raises(CorruptWeights, match=r"expert_1/diffusion_pytorch_model.safetensors: sha256 .* expert 1's"):
        FleetPipeline.from_pretrained(str(model_dir))  # the size is the same, the modification time is not
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--prompt", "a seven", "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "expert 1's weights are corrupted" in err and EXPERT_1 in err
    assert main(["verify", str(model_dir)]) == 1
    assert "expert 1's weights" in capsys.readouterr().err
    os.remove(model_dir / "router" / "diffusion_pytorch_model.safetensors")
    flip_a_byte(model_dir / EXPERT_1)  # (back as it was: now the router is what is wrong)
    with pytest.raises(CorruptWeights, match=r"router/diffusion_pytorch_model.safetensors: missing \(the router's"):
        verify_weights(RunRoot(str(model_dir)))


def test_serve_refuses_to_start_on_a_corrupted_expert(model_dir):
    flip_a_byte(model_dir / EXPERT_1)
    proc = subprocess.run(
        [sys.executable, "-m", "flowfleet.cli", "serve", str(model_dir), "--no-ui", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 1 and "expert 1's weights are corrupted" in proc.stderr, proc.stderr[-2000:]


def test_a_verified_folder_is_not_read_again_until_a_file_changes(model_dir, monkeypatch):
    root = RunRoot(str(model_dir))
    assert verify_weights(root) == 4  # 3 experts and the router (a pixel-space fleet has no vae/)
    read = []
    real = model_folder.sha256_of
    monkeypatch.setattr(model_folder, "sha256_of", lambda r, rel: read.append(rel) or real(r, rel))
    assert verify_weights(root) == 4 and read == []  # all remembered by size and modification time
    flip_a_byte(model_dir / EXPERT_1)
    with pytest.raises(CorruptWeights, match="expert 1"):
        verify_weights(root)
    assert read == [EXPERT_1]  # only the changed file is read
    with pytest.raises(CorruptWeights):
        verify_weights(root, use_cache=False)


def test_a_folder_without_sha256sums_opens_with_a_warning_and_verify_says_so(model_dir, caplog, capsys):
    (model_dir / "SHA256SUMS").unlink()
    assert FleetPipeline.from_pretrained(str(model_dir)).num_experts == 3
    assert "no SHA256SUMS" in caplog.text
    assert main(["verify", str(model_dir)]) == 1 and "no SHA256SUMS" in capsys.readouterr().out
    (model_dir / "SHA256SUMS").write_text("not a checksum line\n")
    with pytest.raises(CorruptWeights, match="SHA256SUMS: line 1 is not"):
        verify_weights(RunRoot(str(model_dir)))
