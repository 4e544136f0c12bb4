"""Step caches on a pipeline's transformers: diffusers' own cache hooks, enabled for one request.

Owns: `diffusers_config` (a preset of `dlo.engine.cache_presets` as the diffusers config that
`CacheMixin.enable_cache` takes: FirstBlockCacheConfig, TaylorSeerCacheConfig in its lite form,
MagCacheConfig) and `StepCaches` (every transformer of one pipeline; `request` enables a request's
cache on each for the request's transformer calls and disables it after, whatever happened).
Must never: compute a cache decision itself (diffusers' hooks decide; `dlo.engine.skip_plan` only
reads what they decided or will decide), keep a hook or a cached tensor past the request that made
it (the cache's state is the request's: a later request, or another rank's, never sees it), or let
a cached request pair its CFG calls (`[Note: CFG pairs]`: the uncond lane runs under the cond call's
cache context, so the two would share one cache state).

[Note: a request's cache state] diffusers keeps a cache's state in its hooks (a `StateManager` per
hook, keyed by the pipeline's cache context: "cond", "uncond"). Enabled at a request's start and
disabled at its end, the hooks, and with them every residual and Taylor factor, live exactly as long
as the request: two requests on two ranks of one wave each have their own, and a request that
failed or was abandoned part-way leaves nothing for the next (`disable_cache` in a `finally`).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

from dlo.engine.cache_presets import CacheSpec, FirstBlock, Mag, TaylorSeer


def diffusers_config(spec: CacheSpec, steps: int) -> Any:
    """The diffusers cache config of preset `spec` for a request of `steps` denoising steps."""
    import torch
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if isinstance(spec, FirstBlock):
        return FirstBlockCacheConfig(threshold=spec.threshold)
    if isinstance(spec, TaylorSeer):
        return TaylorSeerCacheConfig(cache_interval=spec.cache_interval,
                                     disable_cache_before_step=spec.disable_cache_before_step,
                                     disable_cache_after_step=spec.disable_cache_after_step,
                                     max_order=spec.max_order, taylor_factors_dtype=getattr(torch, spec.factors_dtype),
                                     use_lite_mode=True)
    if isinstance(spec, Mag):
        return MagCacheConfig(threshold=spec.threshold, max_skip_steps=spec.max_skip_steps,
                              retention_ratio=spec.retention_ratio, num_inference_steps=steps,
                              mag_ratios=list(spec.mag_ratios))
    raise TypeError(f"no step cache preset: {spec!r}")


class StepCaches:
    """The step caches of one pipeline's transformers (Wan2.2: both experts), one request's at a time."""

    def __init__(self, models: Sequence[Any]):
        """`models`: the pipeline's transformers as `dlo.engine.load` returned them (`OffloadedModel`)."""
        self.models = list(models)
        self.modules = [m.module for m in self.models]

    @contextmanager
    def enabled(self, spec: CacheSpec | None, steps: int) -> Iterator[None]:
        """Inside, every transformer runs with `spec`'s cache (none: as it is); on the way out the hooks
        go, with every tensor they held ([Note: a request's cache state])."""
        if spec is None:
            yield
            return
        on: list[Any] = []
        try:
            for m in self.modules:
                m.enable_cache(diffusers_config(spec, steps))  # a config of its own: the hooks keep it
                on.append(m)
            yield
        finally:
            for m in reversed(on):
                m.disable_cache()

    @contextmanager
    def request(self, spec: CacheSpec | None, steps: int, pairs: Any, cfg: bool) -> Iterator[None]:
        """One request's transformer calls: its cache enabled, and CFG pairs (`pairs.request`) only
        without one ([Note: CFG pairs] in `dlo.engine.cfg_pairs`)."""
        with ExitStack() as stack:
            stack.enter_context(self.enabled(spec, steps))
            stack.enter_context(pairs.request(cfg and spec is None))
            yield
