"""Step caches on the served pipeline, in process: a request with a cache equals plain diffusers with
the same cache configuration (`enable_cache`, its own process), bit for bit on the float output and
byte for byte on the PNG, resident and streamed (rank-local); streamed, a block the cache skips is not
copied (TaylorSeer and MagCache: the prefetcher copies exactly the blocks diffusers runs; First Block
Cache: plus the one look-ahead of each call it skips), and the skipped block calls and the bytes not
streamed are counted; the cache lives exactly as long as its request (no hook, no state after it,
also after a request that raised)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.cache_helpers import CACHES, SEQ, cache_setup  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _hooks(module: torch.nn.Module) -> list:
    """Every diffusers hook on `module` or its submodules (without sp there are none but a request's),
    and how many forward hooks each of its modules has."""
    names = []
    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is not None:
            names += list(registry.hooks)
    return names + [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in module.modules()]


@pytest.mark.parametrize("mode", ["resident", "rank-local"])
def test_each_preset_equals_diffusers_enable_cache_and_leaves_nothing_behind(cache_setup, mode):
    from dlo.serving.pipeline import ServingPipeline

    s = cache_setup
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings(mode)), max_sequence_length=SEQ)
    module = pipe.model.module
    hooks = _hooks(module)
    for cache in CACHES:
        counts = s.ref_counts(cache, 1)
        if cache != "none":  # each preset skips some block calls in diffusers, and runs some
            assert 0 < counts["block_runs"] < counts["block_calls"], (cache, counts)
        gen = s.gen(cache, 1)
        before, p = pipe.stats(), pipe.model.prefetcher
        ahead, wasted = p is not None and p.inflight is not None, p.wasted if p is not None else 0
        with torch.inference_mode(), pipe.caches.request(gen, pipe.pairs, True):
            out = pipe.pipe(**pipe.pipeline_kwargs(gen))
            assert module.is_cache_enabled == (cache != "none")
        got, ref = np.asarray(out.frames), s.ref_array(cache, 1)
        assert np.array_equal(got, ref), f"{mode} {cache}: max difference {np.abs(got - ref).max():.3g}"
        after, skipped = pipe.stats(), counts["block_calls"] - counts["block_runs"]
        assert after.block_calls_skipped - before.block_calls_skipped == skipped, cache
        if p is not None and cache != "none":  # streamed: the blocks the cache skipped were not copied
            w = p.wasted - wasted  # First Block Cache: the look-ahead of block 1 in each call it skipped (2 blocks)
            assert w == (skipped // 2 if cache == "first-block" else 0), (cache, w)
            copies = counts["block_runs"] + w - ahead + (p.inflight is not None)  # less the one gathered before
            assert after.gathers - before.gathers == copies, (cache, after.gathers - before.gathers, copies)
            assert {b.shard for b in p.blocks} == {p.blocks[0].shard}
            assert after.bytes_not_streamed - before.bytes_not_streamed == (skipped - w) * p.blocks[0].shard
        assert not module.is_cache_enabled and _hooks(module) == hooks, f"{cache} outlived its request"
    assert not np.array_equal(s.ref_array("first-block", 1), s.ref_array("none", 1))  # the cache changed the image
    # the request path: the served PNG of diffusers with the cache
    assert pipe.run(s.gen("first-block", 2)).outputs[0] == s.ref_bytes("first-block", 2)
    # a request that raises inside its forwards leaves no hook either, and the next request is exact
    gen = s.gen("mag", 2)
    with pytest.raises(RuntimeError, match="boom"), torch.inference_mode(), \
            pipe.caches.request(gen, pipe.pairs, True):
        module.blocks[1].register_forward_pre_hook(_boom)
        try:
            pipe.pipe(**pipe.pipeline_kwargs(gen))
        finally:
            module.blocks[1]._forward_pre_hooks.popitem()
    assert not module.is_cache_enabled and _hooks(module) == hooks
    if mode == "resident":  # a streamed forward stopped mid-way breaks the gather order for good
        assert pipe.run(gen).outputs[0] == s.ref_bytes("mag", 2)
    pipe.close()


def _boom(*_args):
    raise RuntimeError("boom")
