"""dp x sp (issue 14): group shapes, which rank holds which shard and runs which request, idle
sp groups' gathers, configuration errors, and diffusers' context parallelism on the offloaded
model bit-identical to one rank (gloo: Ulysses runs on cpu; ring needs cuda)."""

from __future__ import annotations

import pytest
import torch

from dlo.engine.parallel import (
    Layout,
    LayoutError,
    check_layout,
    check_tokens,
    leader_results,
    wave_assignments,
)
from dlo.engine.settings import OffloadSettings, ParallelSettings
from tests.engine.dist_utils import run_ranks

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (3, 2), (2, 4)]


@pytest.mark.parametrize("dp,sp", LAYOUTS)
def test_layout_groups_are_consecutive_and_cover_every_rank_once(dp, sp):
    lay = Layout(dp, sp)
    groups = lay.sp_groups()
    assert len(groups) == dp and all(len(g) == sp for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(dp * sp))
    assert groups == [list(range(d * sp, (d + 1) * sp)) for d in range(dp)]
    assert lay.shard_group() == list(range(dp * sp))  # weights shared by every rank: g = dp x sp
    assert lay.leaders() == [g[0] for g in groups]
    for r in range(dp * sp):
        assert r in lay.sp_ranks(lay.group_of(r))
        assert lay.sp_rank(r) == r - lay.group_of(r) * sp
        assert lay.is_leader(r) == (r % sp == 0)
    with pytest.raises(IndexError):
        lay.group_of(dp * sp)


@pytest.mark.parametrize("dp,sp", LAYOUTS)
def test_wave_runs_each_request_on_its_sp_ranks_and_leaders_answer(dp, sp):
    lay = Layout(dp, sp)
    for n in range(1, dp + 1):
        reqs = [f"req{i}" for i in range(n)]
        assign = wave_assignments(reqs, lay)
        assert len(assign) == dp * sp
        for r, a in enumerate(assign):
            d = r // sp
            assert a == (reqs[d] if d < n else None), (r, assign)
        results = [f"out{r}" for r in range(dp * sp)]
        assert leader_results(results, lay, n) == [f"out{d * sp}" for d in range(n)]
    with pytest.raises(ValueError):
        wave_assignments([], lay)
    with pytest.raises(ValueError):
        wave_assignments(["x"] * (dp + 1), lay)


@pytest.mark.parametrize("args,msg", [
    ((2, 2, 2), "--dp 2 x --sp 2 = 4 ranks, but this node has 2 devices"),
    ((1, 2, 4), "dp x sp must equal the device count"),
    ((3, 1, 2), "--dp 3 x --sp 1 = 3 ranks, but this node has 2 devices"),
    ((0, 1, None), "--dp must be >= 1"),
    ((1, 0, None), "--sp must be >= 1"),
    ((1, 2, 2, 5), "heads must be a multiple of sp"),
])
def test_bad_layouts_are_refused_in_one_line(args, msg):
    with pytest.raises(LayoutError, match=msg.replace("+", r"\+")) as e:
        check_layout(*args)
    assert "\n" not in str(e.value)


def test_good_layouts():
    assert check_layout(1, 2, 2, 40) == Layout(1, 2)
    assert check_layout(2, 1, 2) == Layout(2, 1)
    assert check_layout(1, 1, 2) == Layout(1, 1)  # sp 1 may use fewer devices than the node has
    assert check_layout(3, 2, None, 2) == Layout(3, 2)  # cpu: any layout
    assert check_layout(1, 2, 2, 5, kind="ring") == Layout(1, 2)  # ring splits the sequence, not heads
    with pytest.raises(LayoutError, match="--sp-kind"):
        check_layout(1, 2, 2, kind="star")


def test_tokens_per_frame_must_split_over_sp():
    check_tokens(16, 16, 16, 1)
    check_tokens(32, 16, 16, 2)
    check_tokens(832, 480, 16, 2)  # 52 x 30 tokens per frame
    with pytest.raises(LayoutError, match="1 tokens per frame"):
        check_tokens(16, 16, 16, 2)
    with pytest.raises(LayoutError, match="multiple of 4"):
        check_tokens(32, 48, 16, 4)


# ---- gloo ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dlo.engine.families.tiny import make_tiny_transformer

    return str(make_tiny_transformer(tmp_path_factory.mktemp("sp") / "wan", "wan", layers=3, dim=64))


def _inputs(seed: int, batch: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 16, 3, 8, 8, generator=gen),
                timestep=torch.tensor([500 + seed + i for i in range(batch)]),
                encoder_hidden_states=torch.randn(batch, 7, 32, generator=gen), return_dict=False)


def _ranks(rank: int, world: int, path: str, dp: int, sp: int, mode: str, cases: tuple) -> dict:
    """Every (exchange, batch) case of one layout on one set of ranks: a fresh model per case, the
    process group and the groups made once (what a launch costs is paid once per layout)."""
    from dlo.engine.parallel import make_groups

    torch.set_num_threads(1)
    groups, lay = make_groups(ParallelSettings(dp, sp), "cpu"), Layout(dp, sp)
    return {case: _case(rank, path, lay, groups, mode, *case) for case in cases}


def _case(rank: int, path: str, lay: Layout, groups, mode: str, exchange: str, batch: int) -> dict:
    import torch.distributed as dist

    import dlo.engine
    from dlo.engine.parallel import enable_sequence_parallel
    from dlo.engine.ulysses import dlo_ulysses_calls

    model = dlo.engine.load(path, settings=OffloadSettings(mode), device="cpu", group=groups.shard_group)
    enabled = enable_sequence_parallel(model.module, groups, "cpu", exchange=exchange)
    out = None
    calls = 2
    if lay.group_of(rank) == 0:  # sp group 0 runs the request (2 transformer calls); the other groups only gather
        with torch.no_grad():
            out = [model.module(**_inputs(s, batch))[0] for s in range(calls)]
    else:
        model.gather_only(calls)
    st = model.stats()
    sp_ranks = sorted(dist.get_process_group_ranks(groups.sp_group)) if groups.sp_group is not None else [rank]
    return {"out": out, "gathers": st.gathers, "collective_bytes": st.collective_bytes, "g": model.report.shard_group_size,
            "r": model.report.rank, "sp_ranks": sp_ranks, "enabled": enabled,
            "dlo_calls": dlo_ulysses_calls(model.module), "blocks": len(model.module.blocks)}


def _one_rank(rank: int, world: int, path: str, batches: tuple[int, ...]) -> dict:
    import dlo.engine

    torch.set_num_threads(1)
    model = dlo.engine.load(path, settings=OffloadSettings("resident"), device="cpu")
    with torch.no_grad():
        return {batch: [model.module(**_inputs(s, batch))[0] for s in range(2)] for batch in batches}


@pytest.fixture(scope="module")
def reference(tiny):
    """One rank's outputs for batch 1 and 2 (one launch for the module)."""
    return run_ranks(1, _one_rank, tiny, (1, 2))[0]


# Per layout, its (exchange, batch) cases. Exchanges: `diffusers` is diffusers' own Ulysses; `lean`
# and `overlap` (the default) route Wan's self-attention through dlo.engine.ulysses (rotary embedding
# into the send buffer, attention per destination chunk sent as it finishes; `overlap` also
# exchanging q/k/v while projecting). Batch 2 takes the layouts' copies that batch 1 skips (send
# buffers, the received sequence).
LAYOUT_CASES = [
    ((1, 2, "allgather"), (("diffusers", 1), ("lean", 1), ("overlap", 1))),
    ((2, 2, "allgather"), (("diffusers", 1), ("lean", 1), ("overlap", 1))),
    ((1, 2, "resident"), (("diffusers", 1), ("lean", 2), ("overlap", 2))),
    ((1, 4, "resident"), (("lean", 1), ("overlap", 1))),
    ((1, 2, "rank-local"), (("diffusers", 1),)),
]


@pytest.mark.parametrize("layout,cases", LAYOUT_CASES, ids=[f"dp{d}-sp{s}-{m}" for (d, s, m), _ in LAYOUT_CASES])
def test_sequence_parallel_on_the_offloaded_model_is_bit_identical_to_one_rank(tiny, reference, layout, cases):
    """Every exchange, in every layout, batch 1 and 2: bit-identical to one rank."""
    dp, sp, mode = layout
    res = run_ranks(dp * sp, _ranks, tiny, dp, sp, mode, cases)
    lay = Layout(dp, sp)
    for case in cases:
        exchange, batch = case
        by_rank = [r[case] for r in res]
        for r, got in enumerate(by_rank):
            assert got["enabled"] is True
            runs = lay.group_of(r) == 0
            # every block's self-attention of both calls took DLO's path, on the running ranks only
            assert got["dlo_calls"] == (got["blocks"] * 2 if exchange != "diffusers" and runs else 0), (case, got["dlo_calls"])
            assert got["sp_ranks"] == lay.sp_ranks(lay.group_of(r))
            if mode == "allgather":
                assert (got["g"], got["r"]) == (dp * sp, r), "the shard group must span every rank of the node"
            if runs:
                for a, b in zip(got["out"], reference[batch]):
                    assert a.shape[0] == batch and torch.equal(a, b), \
                        f"{case} rank {r}: max abs diff {(a - b).abs().max().item()}"
            else:
                assert got["out"] is None
        if mode == "allgather":
            # idle sp groups took part in exactly the gathers of the running group's calls
            assert len({(g["gathers"], g["collective_bytes"]) for g in by_rank}) == 1, (case, by_rank)
            assert by_rank[0]["gathers"] > 0


def _capped_groups(rank: int, world: int, dp: int, sp: int) -> dict:
    from dlo.engine.parallel import make_groups

    groups = make_groups(ParallelSettings(dp, sp, gather_max_ctas=4), "cpu")
    return {"shard_group": groups.shard_group, "sp_group": groups.sp_group is not None}


@pytest.mark.parametrize("dp,sp", [(2, 1), (1, 2)])
def test_the_cta_cap_is_ignored_where_the_backend_has_none(dp, sp):
    """gloo has no CTAs: the gathers stay on the default group (the cap applies to NCCL only)."""
    for res in run_ranks(dp * sp, _capped_groups, dp, sp):
        assert res["shard_group"] is None
        assert res["sp_group"] == (sp > 1)
