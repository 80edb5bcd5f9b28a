"""`flowfleet assemble` + `flowfleet generate` from the command line: files written, usage bars, one-line
errors. A random-weight fleet stands in for trained experts; a hash text encoder stands in for MiniLM."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.random_fleet import tiny_run_config, write_random_fleet
from fixtures.tolerances import gamma
from PIL import Image

from flowfleet.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def generate(model_dir, *args):
    return main(["generate", str(model_dir), "--steps", "3", *args])


@pytest.mark.parametrize("strategy,k", [("top1", 1), ("top2", 2), ("full", 3)])
def test_generate_writes_grid_routing_json_and_heatmap(model_dir, tmp_path, capsys, strategy, k):
    out = tmp_path / "samples" / f"{strategy}.png"
    rc = generate(
        model_dir,
        "--prompt",
        "a handwritten seven",
        "--prompt",
        "a zero",
        "--n",
        "6",
        "--strategy",
        strategy,
        "--cfg",
        "3",
        "--out",
        str(out),
    )
    assert rc == 0
    grid = Image.open(out)
    assert grid.size == (3 * 64, 2 * 64)  # 6 samples, 8x8 cells upscaled to 64 px, 3 columns
    routing = json.loads((tmp_path / "samples" / f"{strategy}.routing.json").read_text())
    assert routing["settings"] == {
        "strategy": strategy,
        "k": k,
        "steps": 3,
        "sampler": "euler",
        "guidance_scale": 3.0,
        "shift": 1.0,
        "route_every": 1,
        "seed": 0,
        "cache": 0.0,  # the first-block cache is off unless --cache
        # guidance at every step unless --guidance-max-t or the fleet's model_index.json say otherwise
        "guidance_max_t": 1.0,
        "guidance": "mixture",  # (the fleet's router is blind to the prompt: one rule)
    }
    assert routing["num_steps"] == 3 and routing["num_samples"] == 6
    assert routing["prompts"] == ["a handwritten seven", "a zero"] * 3
    for step in routing["steps"]:
        assert len(step["experts"]) == 6 and all(len(e) == k for e in step["experts"])
        # k float32 weights, each rounded to 6 decimals in the JSON (<= 5e-7 apiece), summed to 1
        assert all(abs(sum(w) - 1) <= k * 5e-7 + gamma(k, torch.float32) for w in step["weights"])
    usage = routing["usage"]
    assert sum(u["selections"] for u in usage.values()) == 6 * 3 * k
    assert sum(u["forward_rows"] for u in usage.values()) == 2 * 6 * 3 * k  # CFG: cond + uncond rows
    used = {e for step in routing["steps"] for row in step["experts"] for e in row}
    assert {int(e) for e, u in usage.items() if u["loads"]} == used  # lazily loaded: only what was selected
    assert Image.open(tmp_path / "samples" / f"{strategy}.routing.png").size[0] > 600
    printed = capsys.readouterr().out
    assert "expert usage" in printed and f"wrote {out}" in printed


def test_generate_defaults_and_determinism(model_dir, capsys):
    assert generate(model_dir, "--prompt", "a digit", "--n", "2") == 0
    default_png = model_dir / "samples" / "top2-seed0.png"  # strategy from model_index.json
    first = default_png.read_bytes()
    assert generate(model_dir, "--prompt", "a digit", "--n", "2") == 0
    assert default_png.read_bytes() == first
    assert generate(model_dir, "--prompt", "a digit", "--n", "2", "--seed", "1") == 0
    assert (model_dir / "samples" / "top2-seed1.png").read_bytes() != first


def test_offload_and_route_every_are_recorded(model_dir, tmp_path):
    out = tmp_path / "o.png"
    assert (
        generate(
            model_dir,
            "--prompt",
            "a digit",
            "--n",
            "8",
            "--strategy",
            "top2",
            "--offload",
            "1",
            "--route-every",
            "2",
            "--sampler",
            "heun",
            "--out",
            str(out),
        )
        == 0
    )
    routing = json.loads((tmp_path / "o.routing.json").read_text())
    assert [s["router_ran"] for s in routing["steps"]] == [True, False, True]
    assert routing["router_calls"] == 2
    loads = sum(u["loads"] for u in routing["usage"].values())
    used = {e for s in routing["steps"] for row in s["experts"] for e in row}
    assert loads > len(used) >= 2  # two experts per sample with room for one: reloads happen


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "x", "--strategy", "best"], "--strategy: unknown strategy 'best'"),
        (["--prompt", "x", "--strategy", "topk:4"], "k=4 exceeds the 3 experts present"),
        (["--prompt", ""], "--prompt: empty prompt"),
        ([], "--prompt: required"),
        (["--prompt", "x", "--offload", "0"], "--offload: must be >= 1"),
        (["--prompt", "x", "--out", "grid.jpg"], "must name a .png file"),
    ],
)
def test_bad_input_is_one_line(model_dir, capsys, args, message):
    assert generate(model_dir, *args) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("flowfleet generate: error:")


def test_a_bad_out_is_refused_before_the_folder_is_read(tmp_path, capsys):
    # tmp_path is not a model folder: a check of --out made after opening it would report the folder instead
    assert main(["generate", str(tmp_path), "--prompt", "x", "--out", "grid.jpg"]) == 1
    err = capsys.readouterr().err
    assert "must name a .png file" in err and "model_index.json" not in err


def test_missing_expert_folder_is_one_line(model_dir, capsys):
    import shutil

    shutil.rmtree(model_dir / "expert_1")
    assert generate(model_dir, "--prompt", "x") == 1
    err = capsys.readouterr().err
    assert "expert_1: missing (model_index.json lists expert 1)" in err and err.count("\n") == 1


def test_not_a_model_folder(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 1
    assert "model_index.json: missing (not an assembled fleet" in capsys.readouterr().err


def test_assemble_cli_partial_warning(run_root, capsys):
    write_random_fleet(str(run_root), tiny_run_config(3), experts=[0, 2])
    assert main(["assemble", str(run_root)]) == 1
    assert "expert 1 is not finished" in capsys.readouterr().err
    assert main(["assemble", str(run_root), "--allow-partial", "--out", str(run_root / "m")]) == 0
    captured = capsys.readouterr()
    assert "warning: partial fleet: expert 1 left out" in captured.err
    assert "experts [0, 2] of K = 3" in captured.out


@pytest.mark.parametrize(
    "command,options",
    [
        ("assemble", ["--out", "--allow-partial"]),
        (
            "generate",
            [
                "--prompt",
                "--n",
                "--strategy",
                "top1 | top2 | topk:K | full",
                "--steps",
                "--sampler",
                "--cfg",
                "--seed",
                "--out",
                "--offload",
                "--route-every",
                "--shift",
            ],
        ),
    ],
)
def test_help_lists_every_option(capsys, command, options):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for opt in options:
        assert opt in text


def test_generate_with_the_runs_own_minilm_reference(run_root, tmp_path):
    """No stand-in: generate builds the bundled MiniLM from text_encoder/'s reference (flowfleet.data.encoders)."""
    write_random_fleet(str(run_root), tiny_run_config(2))
    assert main(["assemble", str(run_root)]) == 0
    out = tmp_path / "m.png"
    assert (
        generate(
            run_root / "model",
            "--prompt",
            "a handwritten digit seven",
            "--n",
            "2",
            "--strategy",
            "top1",
            "--steps",
            "2",
            "--out",
            str(out),
        )
        == 0
    )
    assert Image.open(out).size == (2 * 64, 64)


@pytest.mark.slow
def test_mnist_tiny_end_to_end(tmp_path):
    """init -> prepare -> cluster -> train-all -> assemble -> generate top1 / top2 / full (about 20 min on a
    loaded 2-core box, most of it Inception features in prepare)."""
    run = str(tmp_path / "run")
    for argv in (
        ["init", run, "--preset", "mnist-tiny"],
        ["prepare", run, "--quiet"],
        ["cluster", run, "--quiet"],
        ["train-all", run, "--no-progress"],
        ["assemble", run],
    ):
        assert main(argv) == 0, argv
    for strategy, k in (("top1", 1), ("top2", 2), ("full", 3)):
        out = tmp_path / "samples" / f"{strategy}.png"
        assert (
            main(
                [
                    "generate",
                    f"{run}/model",
                    "--prompt",
                    "a handwritten digit seven",
                    "--n",
                    "8",
                    "--strategy",
                    strategy,
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert Image.open(out).size == (3 * 64, 3 * 64)  # 8 samples of 16x16 on a 3x3 grid of 64 px cells
        routing = json.loads((tmp_path / "samples" / f"{strategy}.routing.json").read_text())
        assert routing["settings"]["k"] == k and routing["num_samples"] == 8
        assert all(len(row) == k for step in routing["steps"] for row in step["experts"])
