"""`add-expert`: new data (here the MNIST digits a run left out) prepared with the run's encoders into
added/1/, a new expert trained on it, the grown fleet's router warm-started from the old one, the model
re-assembled; the old experts untouched; resume, a second addition, errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from fixtures.random_fleet import write_random_fleet

from flowfleet.cli import main
from flowfleet.config import DataConfig, RunConfig, load_run_config
from flowfleet.data.shards import ShardSet
from flowfleet.models.dit import DiTRouter
from flowfleet.models.files import load_model
from flowfleet.presets import preset
from flowfleet.sampling import read_model_index
from flowfleet.stages.add_expert import add_expert
from flowfleet.stages.cluster import cluster
from flowfleet.stages.prepare import prepare
from flowfleet.storage import RunRoot
from flowfleet.train.specs import router_spec
from flowfleet.train.tasks import build_task

pytestmark = pytest.mark.usefixtures("one_thread")

FEW = dict(steps=3, batch_size=8, ckpt_every=100, sample_every=100, log_every=1, warmup_steps=0)


def files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """mnist-tiny on the digits 0-7 (of the first 160 source items), clustered in 2, with a random
    finished fleet; `added` is the data of the digits 8 and 9. Built once; each test gets a copy (`run`)."""
    raw = preset("mnist-tiny").to_dict()
    raw["data"].update(limit=160, labels=list(range(8)))
    raw["cluster"].update(k=2, fine_k=8, features="text")  # clusters of captions: one digit each
    raw["router"]["num_outputs"] = 2
    raw["train"].update(FEW)
    raw["router_train"].update(FEW)
    raw["monolith"]["enabled"] = False
    cfg = RunConfig.from_dict(raw)
    path = tmp_path_factory.mktemp("add") / "run"
    root = RunRoot(str(path))
    cfg.save(root)
    prepare(root, progress=False)
    cluster(root, progress=False)
    write_random_fleet(root.url, cfg)
    before = {k: files(path / "experts" / str(k)) for k in (0, 1)}
    added = DataConfig(**{**cfg.data.model_dump(), "labels": [8, 9], "limit": 200})
    return path, added, before


@pytest.fixture
def run(base, tmp_path):
    """This test's own copy of the base run (tests change it, and may run in any order)."""
    src, added, before = base
    path = tmp_path / "run"
    shutil.copytree(src, path)
    return RunRoot(str(path)), path, added, before


def test_add_expert_trains_an_expert_on_the_new_data_and_grows_the_router(run, caplog):
    root, path, added, before = run
    caplog.set_level(logging.INFO, logger="flowfleet")
    assert not (ShardSet(root, "data").load(["labels"])["labels"] >= 8).any()  # the run never saw 8 or 9

    result = add_expert(root.url, added, progress=False)

    cfg = load_run_config(root)
    assert result.addition == 1 and result.experts == [2] and cfg.num_experts == 3
    assert cfg.added[0].data.labels == [8, 9] and cfg.router.num_outputs == 3
    labels = ShardSet(RunRoot(str(path / "added" / "1")), "data").load(["labels"])["labels"]
    assert result.items == labels.numel() > 0 and set(labels.tolist()) == {8, 9}
    assert json.loads((path / "experts" / "2" / "status.json").read_text())["state"] == "done"
    assert result.routers == ["router-k3"]
    assert any("warm start from" in m and "router/final" in m for m in caplog.messages)
    for k in (0, 1):
        assert files(path / "experts" / str(k)) == before[k]  # the old experts: not a byte changed
    index = read_model_index(result.model)
    assert index.present_experts == [0, 1, 2] and index.num_experts == 3
    assert index.source["router"]["job"] == "router-k3"
    assert files(path / "model" / "expert_2") == files(path / "experts" / "2" / "final")

    # The grown router's data: every item, the new ones as cluster 2; its start: the old router.
    task = build_task(root, cfg, router_spec(cfg))
    clusters = task.data.tensors["cluster"]
    assert (clusters == 2).sum() == labels.numel() and set(clusters.tolist()) == {0, 1, 2}
    old = load_model(DiTRouter, root, "router", "final").state_dict()
    start = task.build_model().state_dict()
    for name, tensor in start.items():
        if old[name].shape == tensor.shape:
            assert torch.equal(tensor, old[name]), name
        else:  # the head: the old experts' rows kept, a new row for expert 2
            assert tensor.shape[0] == 3 and torch.equal(tensor[:2], old[name]), name

    # The same command again: resumed, nothing retrained.
    caplog.clear()
    again = add_expert(root.url, added, progress=False)
    assert again.experts == [2] and any("resuming addition 1" in m for m in caplog.messages)
    assert load_run_config(root).num_experts == 3


def test_an_interrupted_second_addition_of_two_experts_resumes_where_it_stopped(run, monkeypatch, caplog):
    """After a first addition (expert 2, router-k3), a second one split into two experts (--k 2: its 8s and
    9s), interrupted before its router: the same command resumes it (the experts already trained are not
    trained again) and warm-starts from router-k3."""
    import flowfleet.stages.add_expert as stage

    root, path, added, _ = run
    assert add_expert(root.url, added, progress=False).experts == [2]  # the first addition
    caplog.set_level(logging.INFO, logger="flowfleet")
    second = DataConfig(**{**added.model_dump(), "limit": 120})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "train_job", interrupted)  # the stage trains its routers through it (experts not)
    with pytest.raises(KeyboardInterrupt):
        add_expert(root.url, second, k=2, progress=False)
    cfg = load_run_config(root)
    assert len(cfg.added) == 2 and cfg.num_experts == 5
    assert (cfg.expert_origin(3), cfg.expert_origin(4)) == ((2, 0), (2, 1))
    trained = {k: files(path / "experts" / str(k)) for k in (3, 4)}
    for k in (3, 4):
        assert json.loads((path / "experts" / str(k) / "status.json").read_text())["state"] == "done"
    # its two clusters are its two digits (clusters of captions)
    mix = json.loads((path / "added" / "2" / "clusters" / "report.json").read_text())["label_mix"]
    assert sorted(sorted(m) for m in mix) == [["8"], ["9"]]

    monkeypatch.undo()
    result = add_expert(root.url, second, k=2, progress=False)
    assert any("resuming addition 2" in m for m in caplog.messages)
    assert result.addition == 2 and result.experts == [3, 4] and result.routers == ["router-k5"]
    assert any("warm start from" in m and "router-k3/final" in m for m in caplog.messages)
    assert {k: files(path / "experts" / str(k)) for k in (3, 4)} == trained  # not trained twice
    assert read_model_index(result.model).present_experts == [0, 1, 2, 3, 4]
    assert load_run_config(root).num_experts == 5


def test_a_ddpm_expert_joins_a_flow_matching_fleet(run, capsys):
    """add-expert --objective ddpm: the new expert learns DDPM's noise (run.yaml expert_overrides, its folder's
    config.json), the old ones stay flow-matching, and the grown fleet samples; a ddpm expert without a
    schedule is one line naming the setting."""
    root, path, added, _ = run
    args = ["add-expert", str(path), "--source", "mnist", "--labels", "8,9", "--limit", "200", "--objective", "ddpm"]
    assert main([*args, "--no-progress"]) == 1
    assert "expert_overrides.2.schedule: a ddpm model needs its VP schedule" in capsys.readouterr().err
    assert load_run_config(root).num_experts == 2  # nothing written
    assert main([*args, "--schedule", "linear", "--no-progress"]) == 0
    cfg = load_run_config(root)
    assert cfg.expert_config(2).objective == "ddpm" and cfg.expert_config(2).schedule == "linear"
    assert [cfg.expert_config(k).objective for k in (0, 1)] == ["fm", "fm"]
    recorded = json.loads((path / "model" / "expert_2" / "config.json").read_text())
    assert (recorded["objective"], recorded["schedule"]) == ("ddpm", "linear")
    from fixtures.random_fleet import HashTextEncoder

    from flowfleet.sampling.pipeline import FleetPipeline

    text = HashTextEncoder(cfg.encoders.text.width, cfg.encoders.text.max_length)
    out = FleetPipeline.from_pretrained(str(path / "model"), text_encoder=text)(
        ["a handwritten digit 8"], 2, strategy="full"
    )
    assert out.images.isfinite().all()


def test_add_expert_cli_refuses_bad_input(run, capsys):
    root, _, _, _ = run
    assert main(["add-expert", root.url, "--source", "mnist", "--labels", "8,x"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "flowfleet add-expert: error: --labels: '8,x' is not a comma-separated list of integers"
    )
    assert main(["add-expert", root.url, "--source", "folder"]) == 1
    assert "path: required for source 'folder'" in capsys.readouterr().err
    assert main(["add-expert", root.url, "--source", "mnist-7"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "flowfleet add-expert: error: --source mnist-7: source: Input should be 'mnist', 'mnist-10k', 'mnist-70k', "
        "'mnist-5k', 'emoji', 'shapes', 'folder', 'webdataset', 'parquet' or 'hf_disk'"
    )
