"""The deployment plan counts a step cache's kept state: every transformer call of a family that runs
caches carries the largest preset's state (First Block Cache's), in every mode, or with CFG pairs in
rank-local mode the waiting lane's where that is larger (a cached request runs unpaired); and the count
covers what diffusers' hooks really keep during a request, measured on the tiny Wan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlo.engine.settings import EngineSettings, OffloadSettings
from dlo.plan.memory_model import RequestBounds, Shape, pipeline_memory
from dlo.plan.memory_table import MemoryTable
from tests.engine.cache_helpers import SEQ, SIZE, cache_setup  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _kept_bytes(module: torch.nn.Module) -> int:
    """The bytes of every tensor the cache hooks' states on `module` hold now (each storage once)."""
    seen: dict[int, int] = {}

    def add(v: object) -> None:
        if isinstance(v, torch.Tensor):
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        elif isinstance(v, (list, tuple)):
            for x in v:
                add(x)
        elif isinstance(v, dict):
            for x in v.values():
                add(x)

    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            manager = getattr(hook, "state_manager", None)
            for state in (manager._state_cache.values() if manager is not None else ()):
                add(vars(state))
    return sum(seen.values())


def test_the_plan_counts_what_the_largest_cache_keeps(cache_setup):
    from dlo.serving.pipeline import ServingPipeline

    s = cache_setup
    bounds = RequestBounds(SIZE, SIZE, 1, 1, SEQ)
    memory = pipeline_memory(s.model, bounds, tile_above_pixels=10**9, table=MemoryTable())
    # First Block Cache's 7 hidden states of dim 32 (2 heads of 16) in bfloat16, or TaylorSeer's factors of
    # the output projection (16 channels x 2 x 2 patch) up to order 4 in float32, a context: the larger
    assert memory.cache_state == (max(7 * 32 * 2, 2 * 5 * 64 * 4), 0)  # Wan's blocks: one stream
    shape = Shape(SIZE, SIZE, 1, 1)
    counted = memory.carried_bytes(shape, paired=False)
    assert counted == 4 * memory.cache_state[0]  # 2 x 2 latent tokens
    # the lane where larger (rank-local with pairs), else the cache's state: never both
    lane = dataclasses.replace(memory, paired_lane=(10**6, 0))
    assert lane.carried_bytes(shape, paired=True) == 4 * 10**6 and lane.carried_bytes(shape, paired=False) == counted
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings("resident")), max_sequence_length=SEQ)
    module = pipe.model.module
    kept = {}
    for cache in ("first-block", "mag", "taylorseer"):
        gen, seen = s.gen(cache, 1), []
        watch = module.register_forward_hook(lambda *_: seen.append(_kept_bytes(module)))  # after every call
        with torch.inference_mode(), pipe.caches.request(gen, pipe.pairs, True):
            pipe.pipe(**pipe.pipeline_kwargs(gen))
        watch.remove()
        kept[cache] = max(seen)
    # each within the count (the tiny model computes in float32: twice the bfloat16 counted for the
    # hidden states; TaylorSeer's factors are counted in float32, as the test keeps them)
    assert kept["taylorseer"] <= counted and all(k <= 2 * counted for k in kept.values()), kept
    assert 4 * 7 * 32 * 2 < kept["first-block"] <= 2 * 4 * 7 * 32 * 2  # First Block Cache's own term covers it
    assert kept["taylorseer"] > 0 and kept["mag"] > 0
    pipe.close()
