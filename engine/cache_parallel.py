"""Step caches under sequence parallelism: diffusers' cache hooks inside its context-parallel ones.

Owns: `lifted_context_parallel` (a transformer's context-parallel hooks taken off while hooks are
added under them, registered again outermost after) and `decide_on_the_whole_sequence` (First Block
Cache's own rule applied to the residuals of the whole sequence, gathered over the sp group).
Must never: change what a cache decides on one rank (the rule stays diffusers'; only its input is
the whole sequence, as one rank sees it), or leave a context-parallel hook off (a `finally` puts
them back).

[Note: step caches under sp] diffusers' context parallelism (`enable_parallelism`, at load) splits
the sequence with hooks of its own on the same modules a cache hooks (Wan: `blocks.0`, `proj_out`),
and a hook registered later wraps the earlier ones: enabled per request, the cache would see the
whole sequence on the way in and one rank's slice on the way out. So the context-parallel hooks are
taken off before the request's hooks go on and registered again after them, outermost
(`lifted_context_parallel`; diffusers' `remove_hook` does not rewire a wrapping hook's
`original_forward`, so they cannot be moved from under the cache's hooks once these are on): every
cache hook sees its rank's slice, as every block does. A decision made from a tensor's values (First
Block Cache's relative change of the first block's residual) would then differ between the ranks of
one request; its rule runs instead on the residuals gathered over the sp group
(`decide_on_the_whole_sequence`), so every rank takes the decision one rank takes on the whole
sequence. The other presets decide by the step alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

CP_HOOKS = ("cp_input---", "cp_output---")  # diffusers' context-parallel hook names (`hooks/context_parallel.py`)


@contextmanager
def lifted_context_parallel(module: Any) -> Iterator[None]:
    """Inside, `module`'s context-parallel hooks (none without sp) are off; on the way out they are
    registered again, after (outside) whatever was added meanwhile. They are the last hooks of their
    modules on the way in (nothing else adds diffusers hooks between requests), so taking them off
    leaves every other hook's chain whole."""
    lifted = []
    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is None:
            continue
        for name in [n for n in registry.hooks if n.startswith(CP_HOOKS)]:
            lifted.append((registry, name, registry.get_hook(name)))
            registry.remove_hook(name, recurse=False)
    try:
        yield
    finally:  # a registry wraps the forward it finds: the last one registered is outermost
        for registry, name, hook in lifted:
            registry.register_hook(hook, name)


def decide_on_the_whole_sequence(module: Any, group: Any = None) -> None:
    """Under sequence parallelism (over `group`; None: the sp group `module`'s sequence is split over,
    if any), First Block Cache's decision on `module` taken on the whole sequence ([Note: step caches
    under sp]); nothing otherwise."""
    from dlo.engine.parallel import sp_group_of

    group = group if group is not None else sp_group_of(module)
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
