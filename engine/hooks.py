"""How DLO attaches to a module's forward: PyTorch forward hooks kept as removable handles.

Owns: `HookSet` (every hook DLO adds to a model, registered with `register_forward_pre_hook(...,
with_kwargs=True)` / `register_forward_hook` and removed together by `remove()`), and
`attach_prefetcher`, the one entry point that runs a `SlotPrefetcher`'s schedule around each
offloaded block.

Design (after diffusers' `ModelHook` registry): the model stays a plain diffusers `nn.Module`;
nothing replaces `module.forward`, so `close()` leaves the module exactly as diffusers built it,
and several users (the prefetcher, the serving pipeline's progress ticks) stack their hooks on
the same blocks through the same mechanism, in registration order. Each block's forward is
labelled `dlo::block` in a profiler trace (only while a profiler records).
Must never: wrap or replace `forward`, keep a hook it cannot remove, or change the order in which
blocks run (see `[Note: collective order]` in `dlo.engine.prefetch`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle

from dlo.engine.prefetch import SlotPrefetcher, profiling


class HookSet:
    """Forward hooks added to modules, removable all at once."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []

    def add_pre(self, module: nn.Module, fn: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        """`fn(module, args)` (or `fn(module, args, kwargs)` with `with_kwargs`) before each forward."""
        self.handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def add_post(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        """`fn(module, args, output)` after each forward that returns."""
        self.handles.append(module.register_forward_hook(fn))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __len__(self) -> int:
        return len(self.handles)


def attach_prefetcher(prefetcher: SlotPrefetcher, hooks: HookSet) -> None:
    """Run `prefetcher.before_block(i)` before and `after_block()` after offloaded block i.

    The pre-hook waits for block i's slot, binds its parameters to the slot views and issues the
    next block's gather ([Note: stream lifetimes] rule 3, then rule 1 and 2 for the next slot); the
    post-hook records that the slot is free. A forward that raises skips the post-hook, and the next
    block out of order raises `PrefetchOrderError` ([Note: collective order]). Under CFG pairs the
    first lane waits, binds and gathers, the second frees (`SlotPrefetcher.lane`).
    """
    for i, blk in enumerate(prefetcher.blocks):
        ranges: list[Any] = []  # the open `dlo::block` range of this block (profiling only)

        def before(_module: nn.Module, _args: Any, _kwargs: Any, i: int = i, ranges: list = ranges) -> None:
            if profiling():
                rf = record_function("dlo::block")
                rf.__enter__()
                ranges.append(rf)
            if prefetcher.lane != 1:  # CFG pairs' second lane runs the block the first one bound
                prefetcher.before_block(i)

        def after(_module: nn.Module, _args: Any, _output: Any, ranges: list = ranges) -> None:
            if prefetcher.lane != 0:  # ... and frees its slot after it
                prefetcher.after_block()
            while ranges:
                ranges.pop().__exit__(None, None, None)

        hooks.add_pre(blk.module, before, with_kwargs=True)
        hooks.add_post(blk.module, after)
