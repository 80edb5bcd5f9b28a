"""The whole pipeline on s3:// (moto on 127.0.0.1) gives the same expert weights as on a local disk."""

from __future__ import annotations

import safetensors.torch

from flowfleet.config import RunConfig
from flowfleet.presets import preset
from flowfleet.stages.assemble import assemble
from flowfleet.stages.cluster import cluster
from flowfleet.stages.generate import generate
from flowfleet.stages.prepare import prepare
from flowfleet.stages.train import job_status, train_all
from flowfleet.storage import RunRoot

WEIGHTS = "diffusion_pytorch_model.safetensors"


def _small_run() -> RunConfig:
    raw = preset("shapes-tiny").to_dict()
    raw["data"].update(count=48, shard_size=16, batch_size=16)
    raw["encoders"]["semantic"]["name"] = "pixels"  # fast features; the pipeline is what is tested here
    for section in ("train", "router_train"):
        raw[section].update(steps=4, batch_size=8, ckpt_every=2, sample_every=4, log_every=1)
    raw["monolith"]["enabled"] = False
    return RunConfig.from_dict(raw)


def _pipeline(url: str) -> RunRoot:
    root = RunRoot(url)
    _small_run().save(root)
    prepare(url, progress=False)
    cluster(url, progress=False)
    assert train_all(url, parallel=2, progress=False).ok
    assert all(s.state == "done" for s in job_status(url))
    assemble(url)
    return root


def test_s3_run_equals_local_run(s3_url, tmp_path):
    local = _pipeline(str(tmp_path / "run"))
    remote = _pipeline(f"{s3_url}/run")
    assert remote.exists("model", "model_index.json")
    k = _small_run().cluster.k
    for part in [("experts", str(i), "final") for i in range(k)] + [("router", "final")]:
        a = safetensors.torch.load(local.read_bytes(*part, WEIGHTS))
        b = safetensors.torch.load(remote.read_bytes(*part, WEIGHTS))
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].equal(b[name]), f"{'/'.join(part)}: {name} differs"
    out = f"{s3_url}/run/samples/top2.png"
    generate(remote.url_of("model"), prompts=["a red circle"], n=2, steps=2, out=out)
    assert remote.exists("samples", "top2.png") and remote.exists("samples", "top2.routing.json")
