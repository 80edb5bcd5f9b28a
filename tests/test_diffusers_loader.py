"""diffusers' own loader opens an assembled fleet: DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
gives a pipeline with diffusers' call and `.images`, the pixels `flowfleet generate` gives for the same seed, and
experts that still load when first routed to. Run against the newest and the oldest supported diffusers (Makefile)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from fixtures.random_fleet import write_random_fleet
from PIL import Image

from flowfleet.data.autoencoder import build_autoencoder, save_autoencoder
from flowfleet.errors import FlowfleetError
from flowfleet.layout import AUTOENCODER
from flowfleet.presets import preset
from flowfleet.sampling.diffusers_pipeline import FlowfleetDiffusionPipeline
from flowfleet.stages.assemble import assemble
from flowfleet.stages.generate import generate
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "a handwritten digit seven"


@pytest.fixture(scope="module")
def demo_fleet(tmp_path_factory) -> str:
    """An assembled fleet of the demo's architecture (the mnist preset: K = 4 hidden-64 experts on the 8 x 8 x 4
    latent of a run-trained autoencoder, MiniLM prompts, Paris' router), random weights."""
    cfg = preset("mnist")
    root = RunRoot(str(tmp_path_factory.mktemp("diffusers") / "run"))
    cfg.save(root)
    torch.manual_seed(0)
    ae = cfg.encoders.latent.autoencoder
    save_autoencoder(build_autoencoder(ae, cfg.data.channels, cfg.data.image_size), root, AUTOENCODER)
    write_random_fleet(root.url, cfg)
    return assemble(root.url, progress=False).out


def test_diffusers_opens_the_folder_and_draws_generates_pixels(demo_fleet, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        pipe = DiffusionPipeline.from_pretrained(demo_fleet, trust_remote_code=True, offload=1)
    assert "config attributes" not in caplog.text  # model_index.json's keys are not handed to the class
    assert type(pipe).__name__ == "FlowfleetDiffusionPipeline" and pipe.offload == 1
    out = pipe(PROMPT, num_inference_steps=4, guidance_scale=2.0, num_images_per_prompt=3,
               generator=torch.Generator().manual_seed(5), strategy="top2")  # fmt: skip
    assert len(out.images) == 3 and all(isinstance(im, Image.Image) for im in out.images)
    assert len(pipe.fleet.experts.resident) <= 1  # experts load when routed to, at most `offload` kept
    ours = generate(demo_fleet, prompts=[PROMPT], n=3, strategy="top2", steps=4, guidance_scale=2.0, seed=5,
                    out=str(tmp_path / "g.png")).output  # fmt: skip
    from flowfleet.sampling.views import to_pil

    # bit-identical: the same noise (one draw of the seed's generator) through the same computation
    assert [np.asarray(a).tobytes() for a in out.images] == [np.asarray(b).tobytes() for b in to_pil(ours.images)]
    arrays = pipe(PROMPT, num_inference_steps=4, guidance_scale=2.0, num_images_per_prompt=3,
                  generator=torch.Generator().manual_seed(5), strategy="top2", output_type="np").images  # fmt: skip
    side = out.images[0].size[0]  # (an untrained autoencoder's own side: 32)
    assert arrays.shape == (3, side, side, 1) and arrays.dtype == np.float32 and 0 <= arrays.min() <= arrays.max() <= 1
    pil = np.stack([np.asarray(im)[..., 0] for im in out.images])  # the same images, as uint8
    assert np.abs(arrays[..., 0] * 255 - pil).max() <= 0.5
    tensors = pipe([PROMPT, "a handwritten digit one"], num_inference_steps=2, output_type="pt", top_k=1).images
    assert tensors.shape == (2, 1, side, side)


def test_bad_arguments_are_one_line_errors(demo_fleet):
    pipe = DiffusionPipeline.from_pretrained(demo_fleet, trust_remote_code=True)
    with pytest.raises(FlowfleetError, match="output_type: expected one of pil, np, pt, latent"):
        pipe(PROMPT, output_type="tensor")
    with pytest.raises(FlowfleetError, match="prompt: required"):
        pipe(None, num_inference_steps=1)
    with pytest.raises(FlowfleetError, match="from_pretrained"):
        FlowfleetDiffusionPipeline()(PROMPT)


def test_a_folder_assembled_before_still_opens(demo_fleet, tmp_path):
    """Folders assembled before diffusers could open them name their class "FleetPipeline" and have no pipeline.py."""
    import json
    import shutil

    from flowfleet.sampling.pipeline import FleetPipeline

    old = tmp_path / "old"
    shutil.copytree(demo_fleet, old)
    (old / "pipeline.py").unlink()
    index = json.loads((old / "model_index.json").read_text())
    (old / "model_index.json").write_text(json.dumps({**index, "_class_name": "FleetPipeline"}))
    assert FleetPipeline.from_pretrained(str(old)).num_experts == 4
    (old / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(FlowfleetError, match="_class_name: 'StableDiffusionPipeline' is not a flowfleet fleet"):
        FleetPipeline.from_pretrained(str(old))
