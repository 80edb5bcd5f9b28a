"""The first-block cache (`--cache T`, flowfleet.sampling.cache): what it skips, what stands in for the
skipped blocks, and that a threshold nothing passes leaves the sampler's images unchanged."""

from __future__ import annotations

import pytest
import torch
from fixtures.random_fleet import HashTextEncoder, randomize_, tiny_run_config

from flowfleet.errors import FlowfleetError
from flowfleet.models.dit import DiTExpert, DiTRouter
from flowfleet.sampling.cache import BlockCache
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.store import ExpertStore

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small models on a shared 2-core box

K = 3


@pytest.fixture(scope="module")
def pipe() -> FleetPipeline:
    """3 random DiT experts of depth 3 (so 2 blocks can be skipped), cross-attention, a random router."""
    cfg = tiny_run_config(K, depth=3)
    experts = [randomize_(DiTExpert.from_dit_config(cfg.expert), seed=k).eval() for k in range(K)]
    router = randomize_(DiTRouter.from_dit_config(cfg.router), seed=99).eval()
    return FleetPipeline(
        ExpertStore.from_callables(experts),
        router,
        latent_shape=(1, 8, 8),
        conditioning="cross_attn",
        text_encoder=HashTextEncoder(384, 4),
    )


def draw(pipe: FleetPipeline, cache: float, guidance_max_t: float = 1.0):
    settings = pipe.settings("top2", steps=8, guidance_scale=3.0, seed=5, cache=cache, guidance_max_t=guidance_max_t)
    return pipe(["a digit seven", "a round zero"], 4, settings=settings)


@pytest.mark.parametrize("guidance_max_t", [1.0, 0.5])  # 0.5: unguided rows, then guided ones (a cache of each)
def test_a_threshold_nothing_passes_leaves_the_images_unchanged(pipe, guidance_max_t):
    plain, cached = draw(pipe, 0.0, guidance_max_t), draw(pipe, 1e-12, guidance_max_t)
    assert torch.equal(plain.latents, cached.latents)  # the cached forward is DiTModel.forward's arithmetic
    assert cached.trace.stats.cache.blocks_skipped == 0 and cached.trace.stats.cache.blocks_run > 0
    assert plain.trace.stats.cache.blocks_run == 0  # 0: the cache is not built at all


def test_a_sample_whose_first_block_did_not_change_reuses_the_rest_exactly(pipe):
    """Two calls on the same input: the second sees a change of 0 and skips blocks 2 and 3 for every row,
    so its output is block 1 plus the first call's residual of blocks 2..3: the first call's output."""
    expert = pipe.experts.get(0)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.full((4,), 0.6)
    cond = dict(text_tokens=torch.randn(4, 4, 384), text_mask=torch.ones(4, 4, dtype=torch.bool))
    cond["text_pooled"] = torch.randn(4, 384)
    cache = BlockCache(threshold=0.05, rows=6)
    rows = torch.tensor([0, 2, 3, 5])
    with torch.no_grad():
        first = cache.forward(0, expert, rows, x, t, **cond)
        assert (cache.stats.blocks_run, cache.stats.blocks_skipped) == (4 * 3, 0)
        torch.testing.assert_close(first, expert(x, t, **cond), rtol=0, atol=0)  # a full call is the model
        again = cache.forward(0, expert, rows, x, t, **cond)
        assert (cache.stats.blocks_run, cache.stats.blocks_skipped) == (4 * 3 + 4, 4 * 2)
        # block 1 + (h_out - block 1) of the first call: the same tensor up to one add and one subtract
        torch.testing.assert_close(again, first, rtol=0, atol=4 * torch.finfo(torch.float32).eps * first.abs().max())
        # another expert, or rows it never ran in full, start from nothing: they run every block
        cache.forward(1, pipe.experts.get(1), rows, x, t, **cond)
        assert cache.stats.blocks_skipped == 4 * 2


def test_a_loose_threshold_skips_blocks_and_says_how_many(pipe):
    cached = draw(pipe, 0.5)
    stats = cached.trace.stats.cache
    assert stats.blocks_skipped > 0 and 0 < stats.saved < 1
    assert cached.trace.to_json()["cache"]["blocks_skipped"] == stats.blocks_skipped
    assert torch.isfinite(cached.latents).all()


def test_bad_thresholds_and_experts_without_blocks_are_refused_in_one_line(pipe):
    with pytest.raises(FlowfleetError, match=r"^cache: Input should be greater than or equal to 0, got -1$"):
        pipe.settings("top2", cache=-1)
    with pytest.raises(FlowfleetError, match=r"^cache: expert 0 is a function, not a DiT"):
        BlockCache(0.1, 2).bind(0, lambda x, t: x, torch.tensor([0]))
