"""dlo.engine.load on real gloo ranks: every offload mode is bit-identical to resident."""

from __future__ import annotations

import pytest
import torch

from dlo.engine.families.tiny import make_tiny_transformer
from tests.engine.dist_utils import run_ranks
from tests.engine.inputs import forward

CALLS = 4  # more calls than slots: the ring wraps around several times


def _equal_to_resident(rank: int, world: int, models: dict) -> dict:
    from dlo.engine import OffloadSettings, load

    out = {}
    for (family, kind), path in models.items():
        ref_model = load(path, settings=OffloadSettings("resident"), device="cpu")
        dtype = next(ref_model.module.parameters()).dtype if kind != "bf16" else torch.bfloat16
        refs = [forward(ref_model.module, family, s, dtype) for s in range(CALLS)]
        for mode in ("allgather", "rank-local"):
            for weights in ("arena", "registered"):
                m = load(path, settings=OffloadSettings(mode, weights=weights), device="cpu")
                assert m.report.weights_source == weights
                same = [torch.equal(forward(m.module, family, s, dtype), refs[s]) for s in range(CALLS)]
                out[f"{family}-{kind}-{weights}-{mode}"] = (same, _host_source_holds(m, weights),
                                                            m.report.shard_group_size)
                m.close()
    return out


def _host_source_holds(m, weights: str) -> bool:
    """What each weights source promises of the host bytes: `arena` one pinned (mlock'ed on cpu)
    allocation of exactly this rank's shards; `registered` no host copy at all, every transfer read
    from the checkpoint's own file mappings (the page cache)."""
    if weights == "arena":
        shards = sum(b.shard for b in m.prefetcher.blocks)
        return m.host.pinned and m.report.host_pinned_bytes == shards
    mapped = [m._ckpt.file_bytes(p) for p in m._ckpt.files]
    spans = [(w.data_ptr(), w.data_ptr() + w.numel()) for w in mapped]
    return all(any(lo <= src.data_ptr() and src.data_ptr() + src.numel() <= hi for lo, hi in spans)
               for block in m.host.copies for src, _ in block)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])  # g = 4 (dp 2 x sp 2) in test_seqpar
def test_offload_modes_bit_identical_to_resident(models, world):
    results = run_ranks(world, _equal_to_resident, models)
    for rank, res in enumerate(results):
        for key, (same, host_ok, g) in res.items():
            assert all(same), f"rank {rank} {key}: outputs differ from resident on calls {same}"
            assert host_ok, f"rank {rank} {key}: the host bytes are not what the weights source promises"
            assert g == (world if key.endswith("allgather") else 1)


def _gather_only(rank: int, world: int, path: str, gather: str) -> list[bool]:
    from dlo.engine import OffloadSettings, load

    ref_model = load(path, settings=OffloadSettings("resident"), device="cpu")
    refs = [forward(ref_model.module, "flux", s, torch.float32) for s in range(3)]
    # the collective, or peer copies (dlo.engine.peergather)
    m = load(path, settings=OffloadSettings("allgather", transfer=gather), device="cpu")
    assert m.report.transfer == ("peer" if gather == "peer" else "eager"), m.report
    if rank == 1:
        m.gather_only(3)  # the idle rank of a partial wave
        m.gather_only(1)
        return []
    outs = [torch.equal(forward(m.module, "flux", s, torch.float32), refs[s]) for s in range(3)]
    outs.append(torch.equal(forward(m.module, "flux", 0, torch.float32), refs[0]))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["collective", "peer"])
def test_gather_only_on_one_rank_keeps_others_exact(models, gather):
    results = run_ranks(3, _gather_only, models[("flux", "fp32")], gather)
    assert results[1] == []
    assert results[0] == [True] * 4 and results[2] == [True] * 4


def test_single_process_modes_and_report(models):
    import torch.distributed as dist

    from dlo.engine import OffloadSettings, load
    from dlo.engine.blocks import describe
    from dlo.engine.layout import shard_bytes

    path = models[("flux", "fp32")]
    facts = describe(path)
    m = load(path, settings=OffloadSettings("rank-local"), device="cpu")
    r = m.report
    assert (r.mode, r.weights_source, r.blocks) == ("rank-local", "arena", 5)
    assert r.largest_block_bytes == facts.largest_block_bytes
    assert r.slot_bytes == 2 * shard_bytes(facts.largest_block_bytes, 1)
    assert r.resident_bytes >= facts.nonblock_bytes
    # the arena holds each block once, exactly (layout bytes, no power-of-two rounding)
    assert r.host_pinned_bytes < facts.bytes and r.host_pinned_bytes >= facts.bytes - facts.nonblock_bytes
    resident = load(path, settings=OffloadSettings("resident"), device="cpu")
    assert resident.report.blocks == 0 and resident.report.host_pinned_bytes == 0
    # resident_blocks: the first K blocks stay on the device, the rest stream; still exact
    k2 = load(path, settings=OffloadSettings("rank-local", resident_blocks=2), device="cpu")
    assert k2.report.blocks == 3 and k2.report.resident_blocks == 2
    ref = forward(resident.module, "flux", 1, torch.float32)
    assert torch.equal(forward(k2.module, "flux", 1, torch.float32), ref)
    assert torch.equal(forward(m.module, "flux", 1, torch.float32), ref)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        load(path, settings=OffloadSettings("allgather"), device="cpu")
    with pytest.raises(ValueError, match="mode must be one of"):
        load(path, settings=OffloadSettings("sideways"), device="cpu")  # type: ignore[arg-type]


def test_out_of_order_block_breaks_prefetcher_loudly(models):
    from dlo.engine import OffloadSettings, load
    from dlo.engine.prefetch import PrefetchOrderError

    m = load(models[("wan", "bf16")], settings=OffloadSettings("rank-local"), device="cpu")
    block1 = m.module.blocks[1]
    with pytest.raises(PrefetchOrderError, match="block 1 ran but block 0 was expected"):
        block1(torch.zeros(1))
    with pytest.raises(PrefetchOrderError):  # and stays broken: the engine must restart
        forward(m.module, "wan", 0, torch.bfloat16)


def test_page_cache_runs_merge_per_dtype(models):
    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.blocks import block_layout, group_keys
    from dlo.engine.families import BLOCK_FAMILIES
    from dlo.engine.weights import page_cache_runs

    ck = Checkpoint(models[("wan", "bf16")])
    blocks, _ = group_keys(set(ck.tensors), BLOCK_FAMILIES["wan"])
    lay = block_layout(ck, blocks[1])
    runs = page_cache_runs(ck, lay, 1, 0)
    # contiguous in the file and 256-byte sized tensors merge; never more runs than tensors
    assert len(runs) < len(lay.tensors)
    assert sum(r.n for r in runs) == sum(t.nbytes for t in lay.tensors)
    for g in (2, 3):
        total = sum(r.n for rank in range(g) for r in page_cache_runs(ck, lay, g, rank))
        assert total == sum(t.nbytes for t in lay.tensors)


def test_cast_needed_falls_back_to_arena_with_reason(tmp_path):
    from safetensors.torch import load_file, save_file

    from dlo.engine import OffloadSettings, load

    path = make_tiny_transformer(tmp_path / "t", "wan", layers=2, dtype="bfloat16")
    f = path / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "blocks.0.scale_shift_table"  # an fp32-kept module stored in bf16: upcast on load
    sd[key] = sd[key].to(torch.bfloat16)
    save_file(sd, f)
    m = load(path, settings=OffloadSettings("rank-local"), device="cpu")
    assert m.report.weights_source == "arena"
    assert m.module.blocks[0].scale_shift_table.dtype == torch.float32
    with pytest.raises(RuntimeError, match="dtype cast"):
        load(path, settings=OffloadSettings("rank-local", weights="registered"), device="cpu")


def _agreed_resident(rank: int, world: int, path: str) -> list[tuple[int, bool]]:
    from dlo.engine import OffloadSettings, load
    from dlo.engine.offload import agree_on_resident_blocks

    ref = [forward(load(path, settings=OffloadSettings("resident"), device="cpu").module, "wan", s, torch.bfloat16)
           for s in range(CALLS)]
    # Ranks whose devices leave room for different counts (3 and 1 here: what each rank's plan found)
    # run with the smallest, every block beyond it streamed by the same gathers on both.
    agreed = agree_on_resident_blocks({"transformer": 3 - 2 * rank}, "allgather", None, torch.device("cpu"))
    m = load(path, settings=OffloadSettings("allgather", resident_blocks=agreed["transformer"]), device="cpu")
    same = all(torch.equal(forward(m.module, "wan", s, torch.bfloat16), ref[s]) for s in range(CALLS))
    out = [(m.report.resident_blocks, same and m.report.blocks > 0)]
    m.close()
    return out


@pytest.mark.slow
def test_resident_blocks_agree_across_the_shard_group_and_stream_the_rest_bit_identically(models):
    assert run_ranks(2, _agreed_resident, models[("wan", "bf16")]) == [[(1, True)]] * 2


def test_load_takes_a_number_of_resident_blocks_auto_is_sized_by_the_caller(models):
    from dlo.engine import OffloadSettings, load
    from dlo.engine.settings import ConfigError

    # "auto" needs the largest request's peak (dlo serve: dlo.plan.memory_plan); load has no such request
    with pytest.raises(ConfigError, match="resident_blocks 'auto' is sized from the device budget"):
        load(models[("wan", "bf16")], settings=OffloadSettings("rank-local", resident_blocks="auto"), device="cpu")
