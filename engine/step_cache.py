"""Step caches on a pipeline's transformers: diffusers' own cache hooks, enabled for one request.

Owns: `diffusers_config` (a preset of `dlo.engine.cache_presets` as the diffusers config that
`CacheMixin.enable_cache` takes: FirstBlockCacheConfig, TaylorSeerCacheConfig in its lite form,
MagCacheConfig), `StepCaches` (every transformer of one pipeline: `request` enables a request's cache
on each for the request's transformer calls and disables it after, whatever happened, with the
streamed blocks' plan of its calls; `gathering`, the plan of a rank that only gathers for a wave
with a cache; `stats`, the block calls caches skipped) and `BlockRuns` (one request's block calls
and runs, watched).
Must never: compute a cache decision itself (diffusers' hooks decide: `dlo.engine.skip_plan` reads
them), keep a hook or a cached tensor past the request that made it, or let a cached request pair
its CFG calls (`[Note: CFG pairs]`: the uncond lane runs under the cond call's cache context, so the
two would share one cache state).

[Note: a request's cache state] diffusers keeps a cache's state in its hooks (a `StateManager` per
hook, keyed by the pipeline's cache context: "cond", "uncond"). Enabled at a request's start and
disabled at its end, the hooks, and with them every residual and Taylor factor, live exactly as long
as the request: two requests on two ranks of one wave each have their own, and a request that
failed or was abandoned part-way leaves nothing for the next (`disable_cache` on the way out).

[Note: a block's own forward] A cache skips a block inside the block's call: the module is called
(its forward hooks, ours among them, run) but the cache's hook returns without running the forward
it wraps. `BlockRuns` registers a diffusers hook on every block before the cache's, so it is the
innermost: it runs exactly when the block's own forward does. It counts the runs (the calls less the
runs are the block calls skipped, `dlo_cache_block_calls_skipped_total`) and refuses a streamed block
run that the plan did not bind (`PrefetchOrderError`): were a cache to decide otherwise than its plan
read, the block would compute from a slot holding other bytes.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

from diffusers.hooks import HookRegistry, ModelHook

from dlo.engine.cache_parallel import decide_on_the_whole_sequence, lifted_context_parallel
from dlo.engine.cache_presets import CacheSpec, FirstBlock, Mag, TaylorSeer
from dlo.engine.hooks import HookSet
from dlo.engine.prefetch import PrefetchOrderError
from dlo.engine.report import GatherStats
from dlo.engine.request import Generation
from dlo.engine.skip_plan import AllRun, CallPlan, NoneRun, decider_of, exchange_for

RAN_HOOK = "dlo_block_ran"  # the innermost diffusers hook of a watched block ([Note: a block's own forward])


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


class _Ran(ModelHook):
    """The innermost hook of a watched block: its own forward is about to run."""

    def __init__(self, watch: "BlockRuns", index: int | None):
        super().__init__()
        self.watch, self.index = watch, index  # index: the block's place among the streamed ones (None: resident)

    def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.watch.runs += 1
        p = self.watch.prefetcher
        if self.index is not None and p.plan is not None and p.live != self.index:
            raise PrefetchOrderError(f"a step cache ran streamed block {self.index}, which its plan skipped: "
                                     "it would compute from another block's bytes; restart the engine")
        return args, kwargs


class BlockRuns:
    """One transformer's blocks watched for one request ([Note: a block's own forward])."""

    def __init__(self, order: Sequence[Any], prefetcher: Any):
        self.prefetcher, self.order = prefetcher, list(order)
        self.calls = self.runs = 0
        self.hooks = HookSet()
        streamed = {b.module: j for j, b in enumerate(prefetcher.blocks)} if prefetcher is not None else {}
        for blk in self.order:
            self.hooks.add_pre(blk, self._called)
            HookRegistry.check_if_exists_or_initialize(blk).register_hook(_Ran(self, streamed.get(blk)), RAN_HOOK)

    def _called(self, *_args: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        self.hooks.remove()
        for blk in self.order:
            blk._diffusers_hook.remove_hook(RAN_HOOK, recurse=False)


def blocks_in_order(module: Any) -> list[Any]:
    """A transformer's blocks in execution order (its family's block lists)."""
    from dlo.engine.families import family_of

    return [b for name in family_of(type(module).__name__).block_lists for b in module.get_submodule(name)]


class StepCaches:
    """The step caches of one pipeline's transformers (Wan2.2: both experts), one request's at a time."""

    def __init__(self, models: Sequence[Any]):
        """`models`: the pipeline's transformers as `dlo.engine.load` returned them (`OffloadedModel`)."""
        self.models = list(models)
        self._orders = [blocks_in_order(m.module) for m in self.models]
        self._calls = self._runs = 0  # every cached request's block calls and runs so far

    def stats(self) -> GatherStats:
        """The block calls caches skipped so far (`GatherStats.block_calls_skipped`)."""
        return GatherStats(block_calls_skipped=self._calls - self._runs)

    @contextmanager
    def request(self, gen: Generation, pairs: Any, cfg: bool) -> Iterator[None]:
        """One request's transformer calls: its cache (if any) enabled and its calls planned, in a wave
        with a cache (`gen.wave_caches`) planned with the shard group's; CFG pairs (`pairs.request`)
        only without a cache ([Note: CFG pairs] in `dlo.engine.cfg_pairs`)."""
        with ExitStack() as stack:
            for model, order in zip(self.models, self._orders):
                if gen.cache is not None:
                    stack.enter_context(self._cached(model, order, gen.cache, gen.steps))
                elif gen.wave_caches:
                    stack.enter_context(self._planned(model, order, AllRun()))
            stack.enter_context(pairs.request(cfg and gen.cache is None))
            yield

    @contextmanager
    def gathering(self, gen: Generation) -> Iterator[None]:
        """A rank that only gathers for `gen`'s wave: in a wave with a cache, its gathers planned with
        the shard group's ([Note: planned gathers] in `dlo.engine.skip_plan`)."""
        with ExitStack() as stack:
            if gen.wave_caches:
                for model, order in zip(self.models, self._orders):
                    stack.enter_context(self._planned(model, order, NoneRun()))
            yield

    @contextmanager
    def _cached(self, model: Any, order: list[Any], spec: CacheSpec, steps: int) -> Iterator[None]:
        """`spec`'s cache on one transformer for one request ([Note: a request's cache state]); under sp
        inside the context-parallel hooks ([Note: step caches under sp] in `dlo.engine.cache_parallel`)."""
        module = model.module
        with ExitStack() as stack:
            with lifted_context_parallel(module):
                watch = BlockRuns(order, model.prefetcher)
                stack.callback(self._count, watch)
                stack.callback(watch.remove)
                module.enable_cache(diffusers_config(spec, steps))  # a config of its own: the hooks keep it
                stack.callback(module.disable_cache)
            decide_on_the_whole_sequence(module)
            stack.enter_context(self._planned(model, order, decider_of(spec.preset, order)))
            yield

    def _count(self, watch: BlockRuns) -> None:
        self._calls += watch.calls
        self._runs += watch.runs

    @contextmanager
    def _planned(self, model: Any, order: list[Any], decider: Any) -> Iterator[None]:
        """The streamed blocks of `model` gathered as `decider` says, with the shard group's in allgather
        ([Note: planned gathers]); a rank gathering alone plans only for its own cache."""
        p = model.prefetcher
        together = model.report.mode == "allgather" and model.report.shard_group_size > 1
        if p is None or (not together and isinstance(decider, (AllRun, NoneRun))):
            yield
            return
        where = {b: j for j, b in enumerate(order)}
        p.plan = CallPlan(decider, [b.module for b in p.blocks], [where[b.module] for b in p.blocks],
                          exchange_for(p.group) if together else None)
        try:
            yield
        finally:
            p.plan = None
