"""Step caches on the served pipeline, in process: a request with a cache equals plain diffusers with
the same cache configuration (`enable_cache`, its own process), bit for bit on the float output and
byte for byte on the PNG, resident and streamed (rank-local); the cache lives exactly as long as its
request (no hook, no state after it, also after a request that raised)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.cache_helpers import CACHES, SEQ, cache_setup  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _cache_hooks(module: torch.nn.Module) -> list[str]:
    """Every diffusers hook left on `module` or its submodules whose name is a cache's."""
    names = []
    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is not None:
            names += [n for n in registry.hooks if any(k in n for k in ("fbc", "mag", "taylorseer"))]
    return names


@pytest.mark.parametrize("mode", ["resident", "rank-local"])
def test_each_preset_equals_diffusers_enable_cache_and_leaves_nothing_behind(cache_setup, mode):
    from dlo.serving.pipeline import ServingPipeline

    s = cache_setup
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings(mode)), max_sequence_length=SEQ)
    module = pipe.model.module
    for cache in CACHES:
        counts = s.ref_counts(cache, 1)
        if cache != "none":  # each preset skips some block calls in diffusers, and runs some
            assert 0 < counts["block_runs"] < counts["block_calls"], (cache, counts)
        gen = s.gen(cache, 1)
        with torch.inference_mode(), pipe.caches.request(gen.cache, gen.steps, pipe.pairs, True):
            out = pipe.pipe(**pipe.pipeline_kwargs(gen))
            assert module.is_cache_enabled == (cache != "none")
        got, ref = np.asarray(out.frames), s.ref_array(cache, 1)
        assert np.array_equal(got, ref), f"{mode} {cache}: max difference {np.abs(got - ref).max():.3g}"
        assert not module.is_cache_enabled and not _cache_hooks(module), f"{cache} outlived its request"
    assert not np.array_equal(s.ref_array("first-block", 1), s.ref_array("none", 1))  # the cache changed the image
    # the request path: the served PNG of diffusers with the cache
    assert pipe.run(s.gen("first-block", 2)).outputs[0] == s.ref_bytes("first-block", 2)
    # a request that raises inside its forwards leaves no hook either, and the next request is exact
    gen = s.gen("mag", 2)
    with pytest.raises(RuntimeError, match="boom"), torch.inference_mode(), \
            pipe.caches.request(gen.cache, gen.steps, pipe.pairs, True):
        module.blocks[1].register_forward_pre_hook(_boom)
        try:
            pipe.pipe(**pipe.pipeline_kwargs(gen))
        finally:
            module.blocks[1]._forward_pre_hooks.popitem()
    assert not module.is_cache_enabled and not _cache_hooks(module)
    if mode == "resident":  # a streamed forward stopped mid-way breaks the gather order for good
        assert pipe.run(gen).outputs[0] == s.ref_bytes("mag", 2)
    pipe.close()


def _boom(*_args):
    raise RuntimeError("boom")
