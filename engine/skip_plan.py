"""What a step cache skips, as the slot prefetcher needs to know it: per transformer call, the streamed
blocks this rank runs, and the blocks its shard group gathers.

Owns: the deciders (`decider_of`: what diffusers' hooks of a preset have decided, or will decide, for
the call under way: `FirstBlockDecider`, `MagDecider`, `TaylorSeerDecider`; `AllRun` for a request
without a cache and `NoneRun` for a rank that only gathers, in a wave where some request has one),
`CallPlan` (one transformer's plan for the calls of one request or wave: `at(i)` at every streamed
block's turn, `gathers`, `runs`, `next_gathered`) and `Exchange` (the shard group's agreement on a
call's gathers, over a host-side group: `exchange_for`).
Must never: decide for a cache (diffusers' hooks decide: a decider reads their state or applies their
own rule to it without changing it), or let ranks of one shard group plan different gathers
(`[Note: planned gathers]`).

[Note: planned gathers] A rank whose request has a step cache gathers only the streamed blocks some
rank of its shard group runs in the call (`SlotPrefetcher` with a `CallPlan`, `dlo.engine.prefetch`).
What is known when: TaylorSeer (lite) and MagCache decide by the step, from state their hooks kept:
before a call starts, every block's fate is known (their rule applied to that state, unchanged), so
a step they skip streams nothing. First Block Cache decides after its first block ran, from that
block's output: before that, the others count as run (the look-ahead gather of the next block is
issued), after it, their fate is its decision; a skipped call wastes that one gather. In allgather
the ranks agree at fixed turns (`Exchange`): at a call's first streamed block, and once more at the
streamed block after the first block of the transformer where that first block is streamed; each
rank contributes the blocks it runs or may run, and every rank gathers what any rank needs, so a
rank whose request skips takes part in the gathers the others need and nothing more. Every rank of a
wave with a cache plans (`AllRun` where its request has none, `NoneRun` where it has none), so every
rank issues the same gathers in the same order ([Note: collective order] in `dlo.engine.prefetch`).
"""

from __future__ import annotations

from typing import Any, Sequence

Runs = list  # per streamed block: True (runs), False (skipped) or None (not known yet)


class AllRun:
    """A request without a cache in a wave with one: every block runs."""

    def runs(self, blocks: Sequence[Any], now: int) -> Runs:
        return [True] * len(blocks)

    first_always_runs = True


class NoneRun:
    """A rank that only gathers: it runs no block."""

    def runs(self, blocks: Sequence[Any], now: int) -> Runs:
        return [False] * len(blocks)

    first_always_runs = False


def _hook(module: Any, name: str) -> Any:
    registry = getattr(module, "_diffusers_hook", None)
    return registry.get_hook(name) if registry is not None else None


class FirstBlockDecider:
    """diffusers' First Block Cache: its first block always runs; the others run where its decision,
    taken once the first block ran, says so (`FBCSharedBlockState.should_compute`)."""

    def __init__(self, order: Sequence[Any]):
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

        self.head = order[0]  # the transformer's first block in execution order: the hook's head
        self._hook = _hook(self.head, _FBC_LEADER_BLOCK_HOOK)
        if self._hook is None:
            raise RuntimeError("first-block: diffusers put no head hook on the transformer's first block")
        self.first_always_runs = True

    def runs(self, blocks: Sequence[Any], now: int) -> Runs:
        """`now`: the execution position of the block whose turn it is (0: the head's, not run yet)."""
        if now == 0:
            return [True if b is self.head else None for b in blocks]
        rest = bool(self._hook.state_manager.get_state().should_compute)
        return [True if b is self.head else rest for b in blocks]


class MagDecider:
    """diffusers' MagCache: a call runs whole or skips whole, decided by its head hook from the step
    and the error its `mag_ratios` accumulated (`MagCacheHeadHook.new_forward`'s rule, applied here
    to the state it will read, before the call; read back after)."""

    def __init__(self, order: Sequence[Any]):
        from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK

        self._hook = _hook(order[0], _MAG_CACHE_LEADER_BLOCK_HOOK)
        if self._hook is None:
            raise RuntimeError("mag: diffusers put no head hook on the transformer's first block")
        self.first_always_runs = False

    def runs(self, blocks: Sequence[Any], now: int) -> Runs:
        state = self._hook.state_manager.get_state()
        whole = self._will_compute(state) if now == 0 else bool(state.should_compute)
        return [whole] * len(blocks)

    def _will_compute(self, state: Any) -> bool:
        cfg = self._hook.config
        if cfg.calibrate:
            return True
        step = state.step_index
        scale = cfg.mag_ratios[step] if step < len(cfg.mag_ratios) else 1.0
        if step < int(cfg.retention_ratio * cfg.num_inference_steps + 0.5):
            return True
        ratio = state.accumulated_ratio * scale
        err = state.accumulated_err + abs(1.0 - ratio)
        skip = (state.previous_residual is not None and err <= cfg.threshold
                and state.accumulated_steps + 1 <= cfg.max_skip_steps)
        return not skip


class TaylorSeerDecider:
    """diffusers' TaylorSeer, lite: every block's hook decides alike by its own step count, on a fixed
    schedule (`TaylorSeerCacheHook._measure_should_compute`'s rule, applied to the count it will
    advance from, before the block is called)."""

    def __init__(self, order: Sequence[Any]):
        from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

        self._hooks = {b: _hook(b, _TAYLORSEER_CACHE_HOOK) for b in order}
        self.first_always_runs = False

    def runs(self, blocks: Sequence[Any], now: int) -> Runs:
        return [self._will_compute(self._hooks.get(b)) for b in blocks]

    @staticmethod
    def _will_compute(hook: Any) -> bool | None:
        if hook is None:  # a block the preset leaves alone runs
            return True
        step = hook.state_manager.get_state().current_step + 1
        before, after, every = hook.disable_cache_before_step, hook.disable_cache_after_step, hook.cache_interval
        return step < before or (step - before - 1) % every == 0 or (after is not None and step >= after)


def decider_of(preset: str, order: Sequence[Any]) -> Any:
    """The decider of preset `preset` over a transformer's blocks in execution order (`order`)."""
    return {"first-block": FirstBlockDecider, "mag": MagDecider, "taylorseer": TaylorSeerDecider}[preset](order)


_HOST_GROUPS: dict[tuple[int, ...], Any] = {}  # shard group ranks -> its host-side (gloo) group


def exchange_for(group: Any) -> "Exchange":
    """The `Exchange` of shard group `group` (None: the default group): over the group itself where
    it is gloo's, else over a gloo group of the same ranks, made at the first wave with a cache (every
    rank of the wave asks before the wave's first collective: `StepCaches.request` and `gathering`
    are entered before any of its forwards) and kept."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return Exchange(group)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    if ranks not in _HOST_GROUPS:
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")
    return Exchange(_HOST_GROUPS[ranks])


class Exchange:
    """The shard group's agreement on a call's gathers: every rank's needs, OR-ed (an all-reduce MAX
    of one byte per block over a host-side group: no device work, no device sync)."""

    def __init__(self, group: Any):
        self.group = group

    def agree(self, needs: list[bool]) -> list[bool]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(needs, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]


class CallPlan:
    """One transformer's plan of the calls of one request (or of one wave, on a rank that only gathers):
    at each streamed block's turn (`at`), which blocks this rank runs and which the shard group gathers
    ([Note: planned gathers])."""

    def __init__(self, decider: Any, blocks: Sequence[Any], positions: Sequence[int], exchange: Exchange | None):
        """`blocks`: the streamed blocks (modules) in order; `positions`: each one's place in the
        transformer's execution order (0: its first block); `exchange`: the shard group's (None:
        this rank gathers alone)."""
        self.decider, self.blocks, self.positions, self.exchange = decider, list(blocks), list(positions), exchange
        # the second turn to agree at: the block after the transformer's first, where that one streams
        self.second = 1 if self.positions and self.positions[0] == 0 and len(self.blocks) > 1 else None
        self.gathers: list[bool] = [True] * len(self.blocks)
        self._runs: Runs = [True] * len(self.blocks)

    def at(self, i: int) -> None:
        """Streamed block i's turn: at a call's first (i = 0) and at the second turn, what is known now."""
        if i != 0 and i != self.second:
            return
        try:
            runs = self.decider.runs(self.blocks[i:], self.positions[i])
        except ValueError:  # no cache context set (a pipeline that names none): every block may run
            runs = [None] * (len(self.blocks) - i)
        needs = [r is not False for r in runs]
        if self.exchange is not None:
            needs = self.exchange.agree(needs)
        self._runs[i:], self.gathers[i:] = runs, needs

    def runs(self, i: int) -> bool:
        """Whether this rank runs streamed block i in this call (known by its turn)."""
        return self._runs[i] is not False

    def next_gathered(self, i: int) -> int | None:
        """The next streamed block after i the call gathers; None: none."""
        return next((j for j in range(i + 1, len(self.blocks)) if self.gathers[j]), None)

    @property
    def prefetch_next_call(self) -> bool:
        """Whether the next call's first block is gathered at this call's end: only where this rank
        gathers alone and the cache always runs that block (First Block Cache's head, streamed)."""
        return self.exchange is None and self.decider.first_always_runs and self.positions[:1] == [0]
