"""A run-trained latent space (encoders.latent.name autoencoder): prepare trains a small diffusers
AutoencoderKL on the training images only, encodes data/ and eval/ with it (eval/ also keeps the real
images, the evaluation's reference), resumes without retraining, refuses a changed recipe; assemble
carries it into the model folder, whose pipeline decodes with it."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.tolerances import gamma

from flowfleet.config import RunConfig, load_run_config
from flowfleet.data.autoencoder import crop, load_autoencoder, pad
from flowfleet.data.encoders import run_latent_encoder
from flowfleet.data.images import to_uint8
from flowfleet.data.shards import ShardSet
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.digits import mnist_tensors
from flowfleet.layout import AUTOENCODER, AUTOENCODER_RECIPE
from flowfleet.presets import preset
from flowfleet.stages.prepare import prepare
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")

AE = dict(block_out_channels=[8, 8], latent_channels=4, pad_to=20, steps=4, batch_size=16, train_items=48)


def ae_run(path, **ae) -> RunRoot:
    """mnist-tiny (16 px) in a 10 x 10 x 4 latent: 16 px padded to 20, halved once."""
    raw = preset("mnist-tiny").to_dict()
    raw["data"].update(limit=64, holdout=16, shard_size=32, batch_size=16)
    raw["encoders"]["text"]["name"] = "none"
    raw["encoders"]["latent"] = {"name": "autoencoder", "autoencoder": {**AE, **ae}}
    raw["expert"].update(conditioning="none", text_dim=0, text_len=0, input_size=(10, 10), in_channels=4, patch_size=2)
    raw["router"].update(input_size=(10, 10), in_channels=4, patch_size=2)
    raw["cluster"]["features"] = "semantic"
    root = RunRoot(str(path))
    RunConfig.from_dict(raw).save(root)
    return root


def test_pad_and_crop_are_inverse_and_fill_black():
    x = torch.rand(2, 1, 16, 16) * 2 - 1
    padded = pad(x, 20)
    assert padded.shape == (2, 1, 20, 20) and torch.equal(crop(padded, 16), x)
    assert torch.all(padded[..., :2, :] == -1) and torch.all(padded[..., :, -2:] == -1)


def test_config_refuses_a_side_the_latent_grid_cannot_halve():
    raw = preset("mnist-tiny").to_dict()
    raw["encoders"]["latent"] = {"name": "autoencoder", "autoencoder": {"block_out_channels": [8, 8, 8], "pad_to": 18}}
    with pytest.raises(ValueError, match="pad_to: the side 18 must divide by 4"):
        RunConfig.from_dict(raw)
    raw["encoders"]["latent"]["autoencoder"] = {"pad_to": 17}
    with pytest.raises(ValueError, match="pad_to: 17 must be >= data.image_size 16, by an even margin"):
        RunConfig.from_dict(raw)


def test_prepare_trains_the_autoencoder_on_training_images_and_encodes_with_it(tmp_path):
    root = ae_run(tmp_path / "run")
    m = prepare(root, progress=False)
    cfg = load_run_config(root)
    assert cfg.latent_shape == (4, 10, 10) and m.fields["latents"]["shape"] == [4, 10, 10]
    recipe = json.loads(root.read_bytes(AUTOENCODER, AUTOENCODER_RECIPE))
    assert recipe["train_stop"] == 48 and recipe["autoencoder"]["block_out_channels"] == [8, 8]
    vae = load_autoencoder(root, AUTOENCODER)
    assert vae.config["_image_size"] == 16 and vae.config.sample_size == 20

    # data/ is the posterior mean x scaling_factor, and scaling_factor = 1 / std of exactly these
    # training latents (train_items 48 = the 48 training items): their std is 1 up to float32 rounding
    latents = ShardSet(root, "data").load(["latents"])["latents"]
    assert latents.shape == (48, 4, 10, 10)
    assert float(latents.std()) == pytest.approx(1.0, abs=gamma(2 * latents.numel(), torch.float32))
    enc = run_latent_encoder(root, cfg)
    x, _ = mnist_tensors()
    first = torch.nn.functional.interpolate(x[:4], size=16, mode="bilinear", antialias=True)
    assert enc.decode(enc.encode(first)).shape == (4, 1, 16, 16)

    # eval/: the 16 held-out items, latents and the real images (uint8), which no training shard holds
    held = ShardSet(root, "eval").load(["latents", "images", "index"])
    assert held["latents"].shape == (16, 4, 10, 10) and held["images"].dtype == torch.uint8
    assert held["images"].shape == (16, 1, 16, 16)
    assert "images" not in ShardSet(root, "data").manifest().fields
    # ... and evaluate's reference is those real images, not the decoder's reconstructions
    from flowfleet.evaluate.reference import reference_images

    order = torch.arange(16)
    real = torch.cat(list(reference_images(root, cfg, held["latents"], order, 16, 5, "cpu", held["images"])()))
    assert torch.equal(real, held["images"].float() / 127.5 - 1.0)
    # a complete prepare run again trains nothing
    weights = root.read_bytes(AUTOENCODER, "diffusion_pytorch_model.safetensors")
    prepare(root, progress=False)  # complete: nothing retrained
    assert root.read_bytes(AUTOENCODER, "diffusion_pytorch_model.safetensors") == weights
    assert to_uint8(enc.decode(held["latents"][:1])).shape == held["images"][:1].shape


def test_the_encoders_beside_the_autoencoder_give_the_shards_of_a_prepare_without_them(tmp_path, caplog, monkeypatch):
    """prepare with the semantic and text encoders in a process beside the autoencoder's training: data/ and eval/
    equal those of a prepare that encodes everything after it, field by field (both on one thread: the same
    batches through the same encoders); a process stopped early leaves prepare to encode the rest."""
    from flowfleet.stages import prepare_beside

    real_finish = prepare_beside.EncodersBeside.finish

    def finish_when_done(self):  # this autoencoder trains in a blink: let the process finish every item first
        self.process.wait()
        return real_finish(self)

    def run(name: str, **ae) -> RunRoot:
        root = ae_run(tmp_path / name, **ae)
        raw = load_run_config(root).to_dict()
        raw["encoders"]["text"] = {"name": "minilm", "max_length": 8}  # the captions too
        raw["encoders"]["semantic"] = {"name": "inception", "image_size": 75}
        RunConfig.from_dict(raw).save(root)
        return root

    alone, beside = run("alone"), run("beside")
    prepare(alone, progress=False, beside=False)
    with caplog.at_level("INFO", logger="flowfleet.stages.prepare"), monkeypatch.context() as patch:
        patch.setattr(prepare_beside.EncodersBeside, "finish", finish_when_done)
        prepare(beside, progress=False, beside=True)
    assert "64 items' features and captions encoded beside the autoencoder" in caplog.text  # all 48 + 16
    for folder in ("data", "eval"):
        a, b = ShardSet(alone, folder), ShardSet(beside, folder)
        fields = a.manifest().fields
        assert fields == b.manifest().fields and {"features", "text_pooled", "latents"} <= set(fields)
        ta, tb = a.load(list(fields)), b.load(list(fields))
        for key in fields:
            assert torch.equal(ta[key], tb[key]), (folder, key)

    # a process that finished nothing (killed as it starts): prepare encodes every item itself
    stopped = run("stopped")
    real_start = prepare_beside.EncodersBeside.start

    def start_and_kill(*args, **kwargs):
        started = real_start(*args, **kwargs)
        started.process.kill()
        started.process.wait()
        return started

    with caplog.at_level("INFO", logger="flowfleet.stages.prepare"), monkeypatch.context() as patch:
        patch.setattr(prepare_beside.EncodersBeside, "start", start_and_kill)
        prepare(stopped, progress=False, beside=True)
    assert "0 items' features and captions encoded beside the autoencoder" in caplog.text
    ta, tb = ShardSet(alone, "data").load(["features"]), ShardSet(stopped, "data").load(["features"])
    assert torch.equal(ta["features"], tb["features"])


def test_a_changed_autoencoder_is_refused_and_restart_retrains_it(tmp_path):
    root = ae_run(tmp_path / "run")
    prepare(root, progress=False)
    changed = ae_run(tmp_path / "run", steps=5)  # the same folder, run.yaml changed
    with pytest.raises(
        FlowfleetError, match=r"data/manifest.json: prepared with a different encoders.latent.autoencoder.steps"
    ):
        prepare(changed, progress=False)
    root.remove("data", recursive=True)  # even with data/ gone, the old latent space is not reused
    with pytest.raises(FlowfleetError, match=r"autoencoder: trained with a different autoencoder.steps; .* --restart"):
        prepare(changed, progress=False)
    prepare(changed, restart=True, progress=False)
    assert json.loads(root.read_bytes(AUTOENCODER, AUTOENCODER_RECIPE))["autoencoder"]["steps"] == 5


def test_parts_need_the_autoencoder_trained_once_first_and_keep_it_when_one_restarts(tmp_path):
    root = ae_run(tmp_path / "run")
    with pytest.raises(FlowfleetError, match=r"autoencoder: missing; .* --autoencoder-only"):
        prepare(root, progress=False, part=(0, 2))
    from flowfleet.cli import main

    assert main(["prepare", root.url, "--autoencoder-only", "--quiet"]) == 0
    assert prepare(root, progress=False, part=(0, 2)).complete
    weights = root.read_bytes(AUTOENCODER, "diffusion_pytorch_model.safetensors")
    # a part started over keeps the latent space every other part encodes with
    assert prepare(root, progress=False, part=(1, 2), restart=True).complete
    assert root.read_bytes(AUTOENCODER, "diffusion_pytorch_model.safetensors") == weights


def test_the_model_folder_carries_the_autoencoder_and_decodes_with_it(tmp_path):
    from fixtures.random_fleet import write_random_fleet

    from flowfleet.sampling import FleetPipeline
    from flowfleet.stages.cluster import cluster

    root = ae_run(tmp_path / "run")
    prepare(root, progress=False)
    cluster(root, progress=False)
    from flowfleet.stages.assemble import assemble

    write_random_fleet(root.url, load_run_config(root))
    model = assemble(root.url, progress=False).out
    folder = RunRoot(model)
    assert folder.read_bytes("vae", "diffusion_pytorch_model.safetensors") == root.read_bytes(
        AUTOENCODER, "diffusion_pytorch_model.safetensors"
    )
    pipe = FleetPipeline.from_pretrained(model)
    out = pipe(None, n=2, steps=2)
    assert out.latents.shape == (2, 4, 10, 10) and out.images.shape == (2, 1, 16, 16)
    assert torch.equal(out.images, pipe.latent_decoder.decode(out.latents))
