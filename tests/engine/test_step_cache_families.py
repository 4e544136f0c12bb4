"""Step caches on the other families that serve them (Qwen-Image, Flux.1-dev: their tiny presets as
`dlo make-random-model` writes them), resident and streamed: every preset's image equals
plain diffusers' with the same cache configuration (`enable_cache`, its own process) bit for bit, its
served PNG byte for byte, and the block calls skipped are counted as diffusers skipped them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.cache_helpers import CACHES, SEQ, first_block, make_cache_setup
from tests.engine.test_family_pipelines import preset_pipeline

pytestmark = pytest.mark.slow
THRESHOLD = {"tiny-qwen-image": 1.5, "tiny-flux.1-dev": 1.5}  # random weights change a lot a step


@pytest.fixture(scope="module", params=["tiny-qwen-image", "tiny-flux.1-dev"])
def family_setup(request, tmp_path_factory):
    model = preset_pipeline(tmp_path_factory, request.param)  # float32 throughout, as the tiny presets are
    caches = {**CACHES, "first-block": first_block(THRESHOLD[request.param])}  # skips some, not all, here
    return make_cache_setup(model, tmp_path_factory.getbasetemp() / f"cache-reference-{request.param}", caches=caches)


@pytest.mark.parametrize("mode", ["resident", "rank-local"])
def test_each_preset_equals_diffusers_on_qwen_image_and_flux(family_setup, mode):
    from dlo.serving.pipeline import ServingPipeline

    s = family_setup
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings(mode)), max_sequence_length=SEQ)
    try:
        for cache in s.caches:
            counts = s.ref_counts(cache, 1)
            if cache != "none":  # each preset skips some block calls in diffusers, and runs some
                assert 0 < counts["block_runs"] < counts["block_calls"], (cache, counts)
            gen = s.gen(cache, 1)
            before = pipe.stats()
            with torch.inference_mode(), pipe.caches.request(gen, pipe.pairs, True):
                out = pipe.pipe(**pipe.pipeline_kwargs(gen))
            got, ref = np.asarray(out.images), s.ref_array(cache, 1)
            assert np.array_equal(got, ref), f"{mode} {cache}: max difference {np.abs(got - ref).max():.3g}"
            skipped = counts["block_calls"] - counts["block_runs"]
            assert pipe.stats().block_calls_skipped - before.block_calls_skipped == skipped, cache
        assert not np.array_equal(s.ref_array("first-block", 1), s.ref_array("none", 1))  # the cache changed it
        assert pipe.run(s.gen("taylorseer", 2)).outputs[0] == s.ref_bytes("taylorseer", 2)  # the served PNG
    finally:
        pipe.close()
