"""First Block Cache under sequence parallelism decides on the whole sequence ([Note: step caches
under sp] in `dlo.engine.cache_parallel`): on two gloo ranks, each holding half of the sequence of its
first block's residuals, diffusers' own rule wrapped by `decide_on_the_whole_sequence` gives every rank
the decision one rank takes on the whole residuals, where each half alone would decide otherwise."""

from __future__ import annotations

import pytest

from tests.engine.dist_utils import run_ranks

pytestmark = pytest.mark.slow
THRESHOLD = 0.3


def _toy() -> object:
    """A transformer-like module: Wan blocks in `blocks`, with diffusers' First Block Cache hooks."""
    import torch
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    toy = torch.nn.Module()
    toy.blocks = torch.nn.ModuleList([WanTransformerBlock(16, 32, 2, "gelu-approximate") for _ in range(3)])
    apply_first_block_cache(toy, FirstBlockCacheConfig(threshold=THRESHOLD))
    return toy


def _decisions(rank: int, world: int) -> tuple[bool, bool, bool]:
    """(this rank's half alone, the wrapped rule on this rank's half, one rank on the whole sequence)."""
    import torch
    import torch.distributed as dist
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.hooks import CacheContext

    from dlo.engine.cache_parallel import decide_on_the_whole_sequence

    prev = torch.ones(1, 8, 4)
    cur = prev.clone()
    cur[:, :4] += 0.5  # the first half of the sequence moved (relative change 0.5), the second not at all
    half = slice(rank * 4, rank * 4 + 4)

    def head_of(toy: object) -> object:
        head = toy.blocks[0]._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)
        head.state_manager.set_context(CacheContext("cond"))
        return head

    def decide(head: object, previous: object, current: object) -> bool:
        head.state_manager.get_state().head_block_residual = previous
        return head._should_compute_remaining_blocks(current)

    alone = decide(head_of(_toy()), prev[:, half].contiguous(), cur[:, half].contiguous())
    whole = decide(head_of(_toy()), prev, cur)
    toy = _toy()
    decide_on_the_whole_sequence(toy, dist.group.WORLD)
    head = head_of(toy)
    wrapped = decide(head, prev[:, half].contiguous(), cur[:, half].contiguous())
    assert torch.equal(head.state_manager.get_state().head_block_residual, prev[:, half])  # its own slice kept
    return alone, wrapped, whole


def test_first_block_cache_under_sp_decides_on_the_whole_sequence():
    results = run_ranks(2, _decisions)
    alone = [r[0] for r in results]
    assert alone == [True, False]  # each half alone: the ranks of one request would part ways
    assert [r[1] for r in results] == [r[2] for r in results] == [False, False]  # the whole: relative change 0.25
