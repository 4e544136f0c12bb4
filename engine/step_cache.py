"""Step caches on a pipeline's transformers: diffusers' own cache hooks, enabled for one request.

Owns: `diffusers_config` (a preset of `dlo.engine.cache_presets` as the diffusers config that
`CacheMixin.enable_cache` takes: FirstBlockCacheConfig, TaylorSeerCacheConfig in its lite form,
MagCacheConfig), `StepCaches` (every transformer of one pipeline; `request` enables a request's
cache on each for the request's transformer calls and disables it after, whatever happened), and
how a cache composes with sequence parallelism ([Note: step caches under sp]).
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

[Note: step caches under sp] diffusers' context parallelism (`enable_parallelism`, at load) splits
the sequence with hooks of its own on the same modules a cache hooks (Wan: `blocks.0`, `proj_out`),
and a hook registered later wraps the earlier ones: enabled per request, the cache would see the
whole sequence on the way in and one rank's slice on the way out. So the
context-parallel hooks are taken off before `enable_cache` and registered again after it, outermost
(`_lift_context_parallel`; diffusers' `remove_hook` does not rewire a wrapping hook's
`original_forward`, so they cannot be moved from under the cache's hooks once these are on): every
cache hook sees its rank's slice, as every block does. A decision made from a tensor's values (First
Block Cache's relative change of the first block's residual) would then differ between the ranks
of one request; its rule runs instead on the residuals gathered over the sp group (`_decide_on_the_whole_sequence`),
so every rank takes the decision one rank takes on the whole sequence. The other presets decide
by the step alone.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

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
                lifted = _lift_context_parallel(m)
                try:
                    m.enable_cache(diffusers_config(spec, steps))  # a config of its own: the hooks keep it
                    on.append(m)
                finally:  # a registry wraps the forward it finds: the last one registered is outermost
                    for registry, name, hook in lifted:
                        registry.register_hook(hook, name)
                _decide_on_the_whole_sequence(m)
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


CP_HOOKS = ("cp_input---", "cp_output---")  # diffusers' context-parallel hook names (`hooks/context_parallel.py`)


def _lift_context_parallel(module: Any) -> list[tuple[Any, str, Any]]:
    """Remove `module`'s context-parallel hooks (none without sp), to be registered again over a cache's
    ([Note: step caches under sp]); they are the last hooks of their modules here (nothing else adds
    diffusers hooks between requests), so removing them leaves every other hook's chain whole."""
    lifted = []
    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is None:
            continue
        for name in [n for n in registry.hooks if n.startswith(CP_HOOKS)]:
            lifted.append((registry, name, registry.get_hook(name)))
            registry.remove_hook(name, recurse=False)
    return lifted


def _decide_on_the_whole_sequence(module: Any) -> None:
    """Under sequence parallelism, First Block Cache's decision on `module` taken on the whole
    sequence ([Note: step caches under sp]); nothing otherwise."""
    from dlo.engine.parallel import sp_group_of

    group = sp_group_of(module)
    if group is None:
        return
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        head = registry.get_hook(_FBC_LEADER_BLOCK_HOOK) if registry is not None else None
        if head is not None:
            head._should_compute_remaining_blocks = _decide_whole(head, head._should_compute_remaining_blocks, group)


def _decide_whole(head: Any, rule: Callable[[Any], bool], group: Any) -> Callable[[Any], bool]:
    """First Block Cache's decision (`rule`, diffusers' own) taken on the residuals of the whole
    sequence: this rank's slice and the last one gathered over the sp `group` (split along the
    sequence, dimension 1, in rank order) for the call, the state's own slice put back after."""
    import torch
    import torch.distributed as dist

    def whole(t: Any) -> Any:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    def decide(residual: Any) -> bool:
        state = head.state_manager.get_state()
        mine = state.head_block_residual
        if mine is None:
            return rule(residual)
        state.head_block_residual = whole(mine)
        try:
            return rule(whole(residual))
        finally:
            state.head_block_residual = mine

    return decide
