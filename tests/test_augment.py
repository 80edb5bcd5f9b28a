"""Non-leaking augmentation (flowfleet.data.augment): the geometric transform, the per-item parameters
`prepare` writes beside each training item, and the draw that training makes from them."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from fixtures.prepared_runs import images_of, make_run
from fixtures.tolerances import reorder

from flowfleet.data.augment import AUGMENT_DIM, choose, draw_params, transform
from flowfleet.data.images import open_image, to_tensor
from flowfleet.data.shards import ShardSet
from flowfleet.data.sources import MnistSource
from flowfleet.errors import FlowfleetError
from flowfleet.stages.prepare import prepare

# grid_sample's value at a pixel: an affine map of the pixel's grid coordinates (3-term dot products) and
# a bilinear blend of 4 neighbours in [0, 2]; at integer moves one weight is 1 up to those roundings
BILINEAR = reorder(3 + 4, torch.float32, scale=2.0)


def digit_like(side: int = 12) -> torch.Tensor:
    """[1, 1, side, side] in [-1, 1]: an off-centre bright bar on a black background (no symmetry)."""
    x = -torch.ones(1, 1, side, side)
    x[..., 3:9, 4:6] = 1.0
    x[..., 3, 6:8] = 0.5
    return x


def params(dx=0.0, dy=0.0, angle=0.0, scale=0.0) -> torch.Tensor:
    return torch.tensor([[dx, dy, angle, scale]])  # [1, AUGMENT_DIM]


def test_transform_is_the_identity_at_zero_and_moves_by_whole_pixels():
    x = digit_like()
    assert torch.allclose(transform(x, params(), 2, 10, 0.1), x, rtol=0, atol=BILINEAR)
    # dx = 1 at shift 2: the digit moves 2 pixels along the width (background comes in at the edge)
    right = transform(x, params(dx=1.0), 2, 10, 0.1)
    assert torch.allclose(right, torch.roll(x, shifts=-2, dims=-1), rtol=0, atol=BILINEAR)
    down = transform(x, params(dy=-0.5), 4, 10, 0.1)  # -0.5 x 4: 2 pixels the other way, along the height
    assert torch.allclose(down, torch.roll(x, shifts=2, dims=-2), rtol=0, atol=BILINEAR)


def test_transform_rotates_a_quarter_turn_and_scales_about_the_centre():
    x = digit_like()
    quarter = transform(x, params(angle=1.0), 2, 90, 0.1)  # angle +1 at 90 degrees: torch.rot90's direction
    assert torch.allclose(quarter, torch.rot90(x, k=1, dims=(-2, -1)), rtol=0, atol=BILINEAR)
    assert not torch.allclose(quarter, x, atol=0.5)
    # scale +1 at 0.5: 1.5x larger, so more of the image is bright; -1: 0.5x, less
    bright = lambda y: float((y > 0).sum())  # noqa: E731
    assert (
        bright(transform(x, params(scale=1.0), 2, 10, 0.5))
        > bright(x)
        > bright(transform(x, params(scale=-1.0), 2, 10, 0.5))
    )


def test_each_items_parameters_depend_on_its_position_and_the_seed_only():
    both = draw_params([5, 7], copies=3, seed=0)  # [2, 3, 4]
    assert both.shape == (2, 3, AUGMENT_DIM) and both.dtype == torch.float32
    assert both.abs().max() <= 1 and both.std() > 0.3  # uniform in [-1, 1]: sd 1 / sqrt(3)
    assert torch.equal(both[1], draw_params([7], copies=3, seed=0)[0])  # not the batch it was drawn in
    assert not torch.equal(both[0], both[1]) and not torch.equal(both, draw_params([5, 7], copies=3, seed=1))


def test_choose_replaces_items_by_a_copy_with_probability_p():
    b, a = 4000, 3
    latents = torch.zeros(b, 1, 2, 2)
    copies = torch.arange(1, a + 1, dtype=torch.float32).view(1, a, 1, 1, 1).expand(b, a, 1, 2, 2)  # copy j: j+1
    prm = torch.arange(1, a + 1, dtype=torch.float32).view(1, a, 1).expand(b, a, AUGMENT_DIM) / 10
    x0, aug = choose(latents, copies, prm, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(x0, latents) and torch.equal(aug, torch.zeros(b, AUGMENT_DIM))
    x0, aug = choose(latents, copies, prm, 0.3, torch.Generator().manual_seed(0))
    which = x0[:, 0, 0, 0]  # 0: the item itself, j: its copy j - 1
    used = which > 0
    # binomial(4000, 0.3): 5 standard deviations either side
    assert abs(float(used.float().mean()) - 0.3) < 5 * math.sqrt(0.3 * 0.7 / b)
    assert torch.equal(aug[:, 0], which / 10)  # a replaced item carries its own copy's parameters, others zeros
    assert torch.equal(x0, which.view(b, 1, 1, 1).expand_as(x0))  # whole copies, never mixed
    counts = torch.bincount(which[used].long(), minlength=a + 1)[1:].float()
    assert (counts / counts.sum() - 1 / a).abs().max() < 5 * math.sqrt((1 / a) * (1 - 1 / a) / counts.sum())
    x1, _ = choose(latents, copies, prm, 1.0, torch.Generator().manual_seed(0))
    assert bool((x1[:, 0, 0, 0] > 0).all())


def test_prepare_writes_augmented_copies_of_training_items_only(tmp_path):
    kw = dict(limit=40, holdout=8, shard_size=16, batch_size=8, augment={"copies": 2, "seed": 3})
    run = make_run(tmp_path / "r", **kw)
    m = prepare(run, progress=False)
    assert m.fields["aug_latents"] == {"shape": [2, 1, 16, 16], "dtype": "float32"}
    assert m.fields["aug_params"] == {"shape": [2, AUGMENT_DIM], "dtype": "float32"}
    assert m.extra["recipe"]["augment"]["copies"] == 2
    held = ShardSet(run, "eval").manifest()
    assert "aug_latents" not in held.fields and "augment" not in held.extra["recipe"]  # the reference as it is
    data = ShardSet(run, "data").load(["latents", "aug_latents", "aug_params"])
    assert torch.equal(data["aug_params"], draw_params(list(range(32)), 2, 3))  # item i: source position i
    src = MnistSource()
    images = torch.stack([to_tensor(open_image(src.images[i]), 16, 1) for i in range(32)])  # [32, 1, 16, 16]
    for j in range(2):  # the pixel latent is the image: each copy is the transformed image
        want = transform(images, data["aug_params"][:, j], 2.0, 10.0, 0.1)
        assert torch.allclose(data["aug_latents"][:, j], want, rtol=0, atol=BILINEAR)
    assert not torch.allclose(data["aug_latents"][:, 0], data["latents"], atol=0.1)

    parts = make_run(tmp_path / "p", **kw)  # in two parts, merged: the same bytes (each item its own draw)
    for i in range(2):
        prepare(parts, progress=False, part=(i, 2))
    from flowfleet.stages.prepare import merge_parts

    merge_parts(parts, 2, progress=False)
    merged = ShardSet(parts, "data").load(["aug_latents", "aug_params"])
    assert torch.equal(merged["aug_params"], data["aug_params"])
    assert torch.equal(merged["aug_latents"], data["aug_latents"])
    assert images_of(tmp_path / "p", "eval") == images_of(tmp_path / "r", "eval")


def test_a_changed_augmentation_re_encodes_the_training_items_only(tmp_path):
    run = make_run(tmp_path / "r", limit=24, holdout=8, shard_size=16, batch_size=8, augment={"copies": 1})
    prepare(run, progress=False)
    held = ShardSet(run, "eval").manifest().shards
    make_run(tmp_path / "r", limit=24, holdout=8, shard_size=16, batch_size=8, augment={"copies": 2})
    with pytest.raises(
        FlowfleetError, match=r"data/manifest.json: prepared with a different augment.copies; .*--restart"
    ):
        prepare(run, progress=False)
    shutil.rmtree(tmp_path / "r" / "data")  # what --restart discards of data/
    assert prepare(run, progress=False).fields["aug_latents"]["shape"][0] == 2
    assert ShardSet(run, "eval").manifest().shards == held  # eval/ was not encoded again
