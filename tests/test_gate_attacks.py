"""The gate under attack, on the tiny fleet (fixtures.contrib_world): a trusted contributor turned malicious, a stolen
key, or someone who can write only into the folder or bucket the package lies in. Every attack is refused in one line
of printable characters with the run byte for byte as it was (fixtures.contrib_world.refused), at a cost bounded by
the kit's caps; the honest package stays admitted, from a kit with its own parameter cap among them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures.contrib_world import BY_LOSS, files, kit_expert, package, refused, resign, write_expert

from flowfleet.cli import main
from flowfleet.config import load_run_config
from flowfleet.data.shards import parse_shard, shard_bytes
from flowfleet.layout import KITS
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.sampling.card import card_markdown, read_card
from flowfleet.sampling.signing import load_private, sign
from flowfleet.stages.admit import admit
from flowfleet.stages.kit import make_kit, read_kit
from flowfleet.stages.remove_expert import remove_expert
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")
WEIGHTS = f"expert/{WEIGHTS_NAME}"


def sign_as_is(world: Path, pkg: Path, manifest: dict | bytes, key: str = "alice") -> None:
    """manifest.json exactly as given (a dict is dumped) and alice's signature over it: what a thief of her key, or
    she turned attacker, can sign."""
    body = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    (pkg / "manifest.json").write_bytes(body)
    (pkg / "manifest.sig").write_bytes(sign(load_private(world / "keys" / f"{key}.key"), body))


def manifest_of(pkg: Path) -> dict:
    return json.loads((pkg / "manifest.json").read_text())


def admitted(run: Path, pkg: Path, world: Path):
    return admit(str(run), str(pkg), str(world / "trusted.pub"), settings=BY_LOSS, progress=False)


# --------------------------------------------------------------------------------------------------
#                  The bytes checked are the bytes installed; verify compares them
# --------------------------------------------------------------------------------------------------


def test_weights_swapped_in_the_package_after_the_checks_are_not_installed(world, run, tmp_path, monkeypatch):
    """The attacker replaces the weights in the package (its bucket) right after the files check read them: the gate
    reads and installs its own copy, so the expert that serves is the one it checked and the contributor signed."""
    import flowfleet.stages.admit as gate

    pkg = package(world, tmp_path)
    signed = manifest_of(pkg)["files"][WEIGHTS]
    checked = gate.check_files

    def check_then_swap(g):
        checked(g)
        torch.manual_seed(3)
        write_expert(pkg, kit_expert(world))  # untrained weights where the checked ones were

    monkeypatch.setattr(gate, "check_files", check_then_swap)
    result = admitted(run, pkg, world)
    installed = run / "experts" / str(result.expert) / "final" / WEIGHTS_NAME
    assert hashlib.sha256(installed.read_bytes()).hexdigest() == signed
    assert hashlib.sha256((pkg / WEIGHTS).read_bytes()).hexdigest() != signed  # (the package did change)


def test_verify_fails_on_an_installed_contribution_that_is_not_its_signed_bytes(world, run, capsys):
    result = admitted(run, world / "honest", world)
    model = run / "model"
    assert main(["verify", str(model)]) == 0
    capsys.readouterr()
    torch.manual_seed(4)  # other weights of the same shapes in its job folder, then the model assembled again
    weights = {k: v.contiguous() for k, v in kit_expert(world).state_dict().items()}
    safetensors.torch.save_file(weights, run / "experts" / str(result.expert) / "final" / WEIGHTS_NAME)
    assert main(["assemble", str(run)]) == 0  # SHA256SUMS made anew: the checksums alone would pass
    capsys.readouterr()
    assert main(["verify", str(model)]) == 1
    err = capsys.readouterr().err.strip()
    assert f"expert_{result.expert}/{WEIGHTS_NAME}: sha256" in err and "signed manifest" in err and "\n" not in err


# --------------------------------------------------------------------------------------------------
#                           Admitted once, into the fleet it was made for
# --------------------------------------------------------------------------------------------------


def test_a_package_of_another_fleets_kit_is_refused_even_with_the_same_contract(world, tmp_path):
    """A second fleet of the same name and configuration (its data, clusters and weights all the first's): its kits
    carry its own random identity, so a package made from the first fleet's kit is not one of its own."""
    other = tmp_path / "other"
    shutil.copytree(world / "run", other)
    shutil.rmtree(other / KITS)  # its own identity, made with its first kit
    make_kit(RunRoot(str(other)), str(tmp_path / "other-kit"))
    assert read_kit(str(tmp_path / "other-kit")).fleet_id != read_kit(str(world / "kit")).fleet_id
    refused(other, world / "honest", world / "trusted.pub", "signature", "is not one this fleet issued")


def test_the_same_package_is_admitted_once_and_never_again_after_its_expert_is_removed(world, run):
    first = admitted(run, world / "honest", world)
    assert first.expert == 2
    refused(run, world / "honest", world / "trusted.pub", "signature", "this package was admitted before, as expert 2")
    remove_expert(str(run), 2, progress=False)
    refused(run, world / "honest", world / "trusted.pub", "signature", "admitted before, as expert 2 (since removed)")


def test_a_kit_with_its_own_parameter_cap_is_checked_as_issued(world, run, tmp_path):
    """`flowfleet kit --max-params N`: the package made from it is admitted (its cap is the issued kit's, not the
    default's), and that cap is enforced."""
    default = read_kit(str(world / "kit"))
    kit = make_kit(RunRoot(str(run)), str(tmp_path / "big-kit"), max_params=default.max_params * 2)
    pkg = package(world, tmp_path)
    resign(world, pkg, kit=tmp_path / "big-kit")
    assert manifest_of(pkg)["kit"] == kit.fingerprint != default.fingerprint
    assert admitted(run, pkg, world).expert == 2
    make_kit(RunRoot(str(run)), str(tmp_path / "small-kit"), max_params=1000)  # below the expert's size
    pkg2 = package(world, tmp_path, "pkg2")
    resign(world, pkg2, kit=tmp_path / "small-kit")
    refused(run, pkg2, world / "trusted.pub", "files", "over the kit's cap of 1,000")


# --------------------------------------------------------------------------------------------------
#                         Links, folders, FIFOs and devices: never followed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["fleet-weights", "missing", "itself"])
def test_a_symlinked_file_is_refused_alike_whatever_it_points_to(world, run, tmp_path, target):
    """The weights as a link: to the fleet's own expert (whose sha256 the signer knows), to a file that does not
    exist, to itself. The same line each time: no oracle of which of the owner's files exist."""
    pkg = package(world, tmp_path)
    fleet_weights = run / "experts" / "0" / "final" / WEIGHTS_NAME
    (pkg / WEIGHTS).unlink()
    if target == "fleet-weights":
        shutil.copy(fleet_weights, pkg / WEIGHTS)  # sign the fleet's own bytes, then link them in
        resign(world, pkg)
        (pkg / WEIGHTS).unlink()
        os.symlink(fleet_weights, pkg / WEIGHTS)
    elif target == "missing":
        os.symlink(tmp_path / "no-such-file", pkg / WEIGHTS)
    else:
        os.symlink(pkg / WEIGHTS, pkg / WEIGHTS)
    refused(run, pkg, world / "trusted.pub", "signature", f"{WEIGHTS}: a symbolic link (never followed)")


def test_a_symlinked_folder_and_a_stray_subfolder_are_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    shutil.move(pkg / "expert", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", pkg / "expert")
    refused(run, pkg, world / "trusted.pub", "signature", "expert: a symbolic link (never followed)")
    pkg2 = package(world, tmp_path, "pkg2")
    (pkg2 / "deep" / "deeper").mkdir(parents=True)
    refused(run, pkg2, world / "trusted.pub", "signature", "deep: a folder the package may not hold")


def test_a_manifest_that_is_a_fifo_or_a_link_to_a_device_is_refused_at_once(world, run, tmp_path):
    """No key is needed for these: they are refused before any signature is checked, without hanging on the FIFO or
    reading the device."""
    pkg = package(world, tmp_path)
    (pkg / "manifest.json").unlink()
    os.mkfifo(pkg / "manifest.json")
    outcome: dict = {}

    def attempt():
        try:
            refused(run, pkg, world / "trusted.pub", "signature", "manifest.json: not a regular file")
            outcome["ok"] = True
        except BaseException as err:  # (reported below: a thread's failure is not the test's otherwise)
            outcome["error"] = err

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "admit hung on a FIFO"
    assert outcome.get("ok"), outcome.get("error")
    (pkg / "manifest.json").unlink()
    os.symlink("/dev/zero", pkg / "manifest.json")
    refused(run, pkg, world / "trusted.pub", "signature", "manifest.json: not a regular file (a link is never followed")
    pkg2 = package(world, tmp_path, "pkg2")
    (pkg2 / "latents.safetensors").unlink()
    os.mkfifo(pkg2 / "latents.safetensors")
    refused(run, pkg2, world / "trusted.pub", "signature", "latents.safetensors: not a regular file")


# --------------------------------------------------------------------------------------------------
#                                          Size bombs
# --------------------------------------------------------------------------------------------------


def test_a_manifest_or_signature_of_the_wrong_size_is_refused_before_it_is_verified(world, run, tmp_path):
    pkg = package(world, tmp_path)
    body = (pkg / "manifest.json").read_bytes()
    (pkg / "manifest.json").write_bytes(body + b" " * (70 << 10))  # padded past 64 KiB
    refused(run, pkg, world / "trusted.pub", "signature", "manifest.json: over its cap of 65,536 bytes")
    (pkg / "manifest.json").write_bytes(body)
    (pkg / "manifest.sig").write_bytes((pkg / "manifest.sig").read_bytes() + b"\0")
    refused(run, pkg, world / "trusted.pub", "signature", "manifest.sig: over its cap of 64 bytes")


def test_weights_over_the_kits_cap_are_refused_without_reading_them_whole(world, run, tmp_path):
    """A 1 GiB weights file (sparse: no disk), listed and signed under a made-up sha256: the copy stops at the cap."""
    pkg = package(world, tmp_path)
    with open(pkg / WEIGHTS, "wb") as f:
        f.truncate(1 << 30)
    record = manifest_of(pkg)
    record["files"][WEIGHTS] = "0" * 64
    sign_as_is(world, pkg, record)
    t0 = time.perf_counter()
    kit = read_kit(str(world / "kit"))
    cap = kit.max_params * 4 + (1 << 20)
    refused(run, pkg, world / "trusted.pub", "signature", f"{WEIGHTS}: over its cap of {cap:,} bytes")
    assert time.perf_counter() - t0 < 30


def test_a_sample_over_the_kits_rows_is_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    kit = read_kit(str(world / "kit"))
    lat = torch.randn(kit.sample_rows + 1, *kit.latent_shape)
    safetensors.torch.save_file({"latents": lat}, pkg / "latents.safetensors")
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "compatibility", f"{kit.sample_rows + 1} items, the kit takes at most")


def test_sample_fields_that_disagree_on_their_rows_are_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    tensors = safetensors.torch.load_file(pkg / "latents.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first][:-1]
    safetensors.torch.save_file(tensors, pkg / "latents.safetensors")
    resign(world, pkg)
    refused(
        run, pkg, world / "trusted.pub", "compatibility", "latents.safetensors: its fields disagree on their row count"
    )


@pytest.mark.parametrize(
    "change, line",
    [
        ({"width": 99_999_999}, "text_mask: a padded text length of 99999999, not 1 to 1024"),
        ({"lengths": 1}, "text_len: lengths outside 0..8 or not summing to text_tokens'"),
        ({"rows": 1}, "packed text tokens need text_tokens [N, T], text_len [n] and an empty text_mask [0, L]"),
    ],
)
def test_text_tokens_packed_with_lengths_that_lie_are_refused(world, run, tmp_path, change, line):
    pkg = package(world, tmp_path)
    path = pkg / "latents.safetensors"
    tensors, captions = safetensors.torch.load_file(path), parse_shard(path.read_bytes())[1]
    assert tensors["text_mask"].shape == (0, 8)  # the package's tokens are stored unpadded
    if "width" in change:  # an empty mask claiming a huge padded length (costs no byte in the file)
        tensors["text_mask"] = torch.zeros(0, change["width"], dtype=torch.uint8)
    if "lengths" in change:
        tensors["text_len"] = tensors["text_len"] + change["lengths"]
    if "rows" in change:
        tensors["text_mask"] = torch.zeros(change["rows"], 8, dtype=torch.uint8)
    safetensors.torch.save_file(tensors, path, metadata={"captions": json.dumps(captions)})
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "compatibility", line)


# --------------------------------------------------------------------------------------------------
#                         Malformed JSON and safetensors: one line, never a traceback
# --------------------------------------------------------------------------------------------------


def test_deeply_nested_or_malformed_json_is_refused_in_one_line(world, run, tmp_path):
    pkg = package(world, tmp_path)
    sign_as_is(world, pkg, b"[" * 60_000)  # a RecursionError for json.loads
    refused(run, pkg, world / "trusted.pub", "signature", "manifest.json: JSON nested 60000 levels deep")
    sign_as_is(world, pkg, b'{"files": ')
    refused(run, pkg, world / "trusted.pub", "signature", "manifest.json: not JSON")
    pkg2 = package(world, tmp_path, "pkg2")
    (pkg2 / "expert" / "config.json").write_text("[" * 30_000 + "]" * 30_000)
    resign(world, pkg2)
    refused(run, pkg2, world / "trusted.pub", "files", "expert/config.json: JSON nested 30000 levels deep")


@pytest.mark.parametrize(
    "field, value, line",
    [
        ("files", [], "manifest.json: files: Input should be a valid dictionary"),
        ("training", "trained", "manifest.json: training: Input should be a valid dictionary"),
        ("format", "2", "manifest.json: format: Input should be 2"),
        ("files", {"../../run.yaml": "0" * 64}, "is not a plain file name of the package"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_refused_by_its_schema(world, run, tmp_path, field, value, line):
    pkg = package(world, tmp_path)
    record = manifest_of(pkg)
    record[field] = value
    sign_as_is(world, pkg, record)
    refused(run, pkg, world / "trusted.pub", "signature", line)


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize(
    "header, data, line",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },  # fmt: skip
            bytes(24),
            "tensors 'a' and 'b' overlap in the file",
        ),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "run outside the file"),
        ({"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, bytes(16), "16 bytes for a F32 tensor"),
        ({"a": {"dtype": "F32", "shape": "big", "data_offsets": [0, 16]}}, bytes(16), "is not a list of sizes"),
    ],
    ids=["overlapping", "past-the-end", "shape-and-bytes-differ", "wrong-type"],
)
def test_safetensors_with_bad_offsets_are_refused_before_a_tensor_is_read(world, run, tmp_path, header, data, line):
    pkg = package(world, tmp_path)
    write_safetensors(pkg / "heldout.safetensors", header, data)
    resign(world, pkg)
    error = refused(run, pkg, world / "trusted.pub", "files", line)
    assert str(error).startswith("refused (files): heldout.safetensors: ")


def test_a_header_length_past_the_file_is_refused(world, run, tmp_path):
    pkg = package(world, tmp_path)
    (pkg / "heldout.safetensors").write_bytes((1 << 31).to_bytes(8, "little") + b"{}")
    resign(world, pkg)
    refused(run, pkg, world / "trusted.pub", "files", "heldout.safetensors: not a safetensors file (no header of")


# --------------------------------------------------------------------------------------------------
#                           A config that would take forever to build
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change", [{"depth": 1_000_000}, {"hidden_size": 2**40, "num_heads": 2**10}])
def test_a_huge_depth_or_width_is_refused_from_its_numbers_at_once(world, run, tmp_path, change):
    """Counted from the config's numbers (no module is built): refused in well under a second of work."""
    pkg = package(world, tmp_path)
    cfg = {**read_kit(str(world / "kit")).expert, **change}
    (pkg / "expert" / "config.json").write_text(json.dumps(cfg))
    resign(world, pkg)
    t0 = time.perf_counter()
    refused(run, pkg, world / "trusted.pub", "files", "parameters, over the kit's cap of")
    assert time.perf_counter() - t0 < 30  # (the copy and the checks before; building it would not end)


# --------------------------------------------------------------------------------------------------
#                               What the attacker writes, shown safely
# --------------------------------------------------------------------------------------------------


def test_control_characters_in_a_file_name_never_reach_the_terminal(world, run, tmp_path, capsys):
    """A name that would erase the refusal on a terminal and draw "admitted as expert 2" in its place."""
    pkg = package(world, tmp_path)
    evil = "a\r\x1b[2K\x1b[1Aflowfleet: admitted as expert 2\n"
    (pkg / "expert" / evil).write_bytes(b"{}")
    error = refused(run, pkg, world / "trusted.pub", "signature", "not in the signed manifest (added after signing)")
    assert "\x1b" not in str(error) and "\\x1b" in str(error)
    args = ["admit", str(run), str(pkg), "--trusted", str(world / "trusted.pub"), "--judge", "none", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err


def test_markdown_in_captions_is_shown_as_text_on_the_fleets_card(world, run, tmp_path):
    """The contribution's captions name its expert's contents on the card the web page renders: an image link and a
    table's `|` in them are escaped, never Markdown."""
    pkg = package(world, tmp_path)
    tensors, captions = parse_shard((pkg / "latents.safetensors").read_bytes())
    evil = "![x](http://attacker.example/x.png) | injected | cell"
    (pkg / "latents.safetensors").write_bytes(shard_bytes(tensors, [evil] * len(captions)))
    resign(world, pkg)
    result = admitted(run, pkg, world)
    markdown = card_markdown(read_card(str(run / "model")))
    row = next(line for line in markdown.splitlines() if line.startswith(f"| {result.expert} |"))
    assert "![x](" not in markdown and "\\!\\[x\\]" in row
    assert row.count("|") - row.count("\\|") == 7  # the table's own separators only
    assert load_run_config(RunRoot(str(run))).num_experts == 3
    assert files(run / "model")  # (assembled)
