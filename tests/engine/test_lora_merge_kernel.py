"""The merge in one pass (`dlo.engine.lora.merge_kernel.FusedMerge`, [Note: the fused merge]): the
first merge of every kind checked against peft's two steps, a kernel that differs never seen in a
merge, the kinds the Triton kernel takes, and the flag that reaches it. The kernel's own bytes are
the device's (bench/lora_merge_kernel.py); here its launch is a stand-in on cpu."""

from __future__ import annotations

import argparse

import pytest
import torch

from dlo.engine.lora.bank import LoraBank, merge_way
from dlo.engine.lora.merge import MergeCache, MergeWay, merge_weight
from dlo.engine.lora.merge_kernel import DEFAULT_SHAPE, FusedMerge, KernelShape, same_bits
from dlo.engine.lora.merge_steps import two_steps
from dlo.engine.lora.weights import Branch
from dlo.serving.options import add_arguments, serve_config
from dlo.engine.settings import ConfigError, LoraSettings


def _layer(rows: int, cols: int, rank: int, dtype=torch.bfloat16, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=g).to(dtype)
    return weight, Branch(torch.randn(rank, cols, generator=g).to(dtype), torch.randn(rows, rank, generator=g).to(dtype),
                          None, 1.0)


def _counting(launch):
    calls = []
    return calls, lambda out, w, B, A, f: (calls.append(tuple(out.shape)), launch(out, w, B, A, f))


@pytest.mark.parametrize("factor", [None, 0.8])
def test_a_kernel_that_agrees_merges_every_call_after_one_check_per_kind(factor):
    calls, launch = _counting(two_steps)
    fused = FusedMerge(launch, device_type="cpu")
    layers = [_layer(64, 32, 16, seed=1), _layer(64, 32, 16, seed=2), _layer(96, 32, 16, seed=3)]
    for weight, b in layers * 2:
        got = merge_weight(torch.full_like(weight, float("nan")), weight, b, factor, MergeWay(fused))
        assert torch.equal(got, merge_weight(torch.empty_like(weight), weight, b, factor))
    assert len(calls) == fused.launches == 6  # every merge by the kernel
    assert fused.verdicts == {((64, 32), torch.bfloat16, 16, factor is not None): True,
                              ((96, 32), torch.bfloat16, 16, factor is not None): True}


def test_a_kernel_that_differs_never_reaches_a_merge_and_is_not_launched_again(caplog):
    calls, launch = _counting(lambda out, w, B, A, f: (two_steps(out, w, B, A, f), out.add_(1)))
    fused = FusedMerge(launch, device_type="cpu")
    weight, b = _layer(64, 32, 16)
    want = merge_weight(torch.empty_like(weight), weight, b, None)
    for _ in range(3):
        assert torch.equal(merge_weight(torch.empty_like(weight), weight, b, None, MergeWay(fused)), want)
    assert len(calls) == 1 and fused.verdicts == {((64, 32), torch.bfloat16, 16, False): False}
    assert "differs from the two-step merge" in caplog.text
    # another kind is checked on its own
    other, ob = _layer(128, 32, 16)
    merge_weight(torch.empty_like(other), other, ob, None, MergeWay(fused))
    assert len(calls) == 2


def test_a_kernel_that_cannot_launch_leaves_every_merge_to_the_two_steps(caplog):
    calls = []

    def broken(*_args):
        calls.append(1)
        raise RuntimeError("PTX for this card failed to compile")

    fused = FusedMerge(broken, device_type="cpu")
    for rows in (64, 128, 64):
        weight, b = _layer(rows, 32, 16)
        got = merge_weight(torch.full_like(weight, float("nan")), weight, b, 0.8, MergeWay(fused))
        assert torch.equal(got, merge_weight(torch.empty_like(weight), weight, b, 0.8))
    assert len(calls) == 1 and fused.launches == 0 and not fused.verdicts
    assert fused.failed == "RuntimeError: PTX for this card failed to compile"
    assert "cannot run here (RuntimeError: PTX for this card failed to compile)" in caplog.text


def test_prepare_judges_every_kind_of_the_adapters_before_any_merge():
    calls, launch = _counting(two_steps)
    fused = FusedMerge(launch, device_type="cpu")
    branches = [_layer(64, 32, 16, seed=s)[1] for s in (1, 2)] + [_layer(96, 32, 16)[1], _layer(96, 32, 8)[1]]
    fused.prepare(branches, torch.device("cpu"))
    kinds = {((64, 32), torch.bfloat16, 16), ((96, 32), torch.bfloat16, 16)}  # rank 8: not the kernel's
    assert fused.verdicts == {(*k, f): True for k in kinds for f in (False, True)} and len(calls) == 4
    # a kind judged wrong at load is never launched for a request
    wrong = FusedMerge(lambda out, w, B, A, f: (two_steps(out, w, B, A, f), out.add_(1)), device_type="cpu")
    wrong.prepare(branches[:1], torch.device("cpu"))
    assert set(wrong.verdicts.values()) == {False} and wrong.launches == 2
    weight, b = _layer(64, 32, 16)
    merge_weight(torch.empty_like(weight), weight, b, 0.3, MergeWay(wrong))
    assert wrong.launches == 2


def test_no_room_to_compare_gives_the_two_steps_bytes_and_no_verdict(monkeypatch):
    fused = FusedMerge(lambda out, w, B, A, f: out.fill_(7), device_type="cpu")  # a kernel of other bytes
    weight, b = _layer(64, 32, 16)

    def full(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with monkeypatch.context() as m:
        m.setattr(torch, "empty_like", full)
        got = merge_weight(weight.clone(), weight, b, None, MergeWay(fused))
    assert torch.equal(got, merge_weight(torch.empty_like(weight), weight, b, None)) and not fused.verdicts
    merge_weight(torch.empty_like(weight), weight, b, None, MergeWay(fused))  # room now: checked, and refused
    assert fused.verdicts == {((64, 32), torch.bfloat16, 16, False): False}


def test_same_bits_is_bytes_not_values():
    z = torch.zeros(4, dtype=torch.bfloat16)
    assert not same_bits(z, -z) and torch.equal(z, -z)
    nan = torch.full((4,), float("nan"), dtype=torch.bfloat16)
    assert same_bits(nan, nan.clone()) and not torch.equal(nan, nan)


def test_the_kinds_the_kernel_takes():
    fused = FusedMerge(lambda *a: None, device_type="cpu")
    weight, b = _layer(64, 32, 64)
    out = torch.empty_like(weight)
    assert fused.kind(out, weight, b.B, b.A, None) == ((64, 32), torch.bfloat16, 64, False)
    assert fused.kind(out, weight, b.B, b.A, 0.5)[3] is True
    assert fused.kind(out, weight, b.B, b.A, torch.tensor(0.5)) is None  # a tensor factor: two steps
    w32, b32 = _layer(64, 32, 64, torch.float32)
    assert fused.kind(torch.empty_like(w32), w32, b32.B, b32.A, None) is None  # TF32 would round the dot's inputs
    w8, b8 = _layer(64, 32, 8)
    assert fused.kind(out, w8, b8.B, b8.A, None) is None  # tl.dot: K of at least 16
    wt = weight.t().contiguous().t()
    assert fused.kind(out, wt, b.B, b.A, None) is None  # not contiguous
    assert FusedMerge(lambda *a: None).kind(out, weight, b.B, b.A, None) is None  # cuda's kernel, cpu tensors
    other, ob = _layer(64, 48, 64)  # shapes that do not make out: the torch steps raise, the kernel would read past
    assert fused.kind(out, other, b.B, b.A, None) is None and fused.kind(out, weight, ob.B, ob.A, None) is None
    assert fused.kind(out, weight, b.B, ob.A[:32], None) is None


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["/m", *argv])


def test_the_flag_reaches_the_bank_s_way(tmp_path, capsys):
    assert serve_config(_args("--lora-merge-kernel", "triton")).lora.merge_kernel == "triton"
    assert serve_config(_args("--lora-merge-kernel", "torch")).lora.merge_kernel == "torch"
    assert _args().lora_merge_kernel == "triton" == LoraSettings("/l").merge_kernel
    with pytest.raises(SystemExit) as exit_:
        _args("--lora-merge-kernel", "cuda")
    assert exit_.value.code == 2 and "--lora-merge-kernel: invalid choice: 'cuda'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lora merge_kernel must be one of"):
        LoraSettings("/l", merge_kernel="cuda")
    assert FusedMerge.on(torch.device("cpu")) is None
    assert merge_way(LoraSettings("/l", merge_kernel="triton"), torch.device("cpu")) == MergeWay()
    assert LoraBank.load(LoraSettings(None), "WanPipeline", tmp_path, None, torch.device("cpu")).way == MergeWay()


def test_the_merge_cache_keeps_merges_in_new_tensors_on_cpu():
    cache = MergeCache(1 << 20)
    p = cache.new_parameter((4, 8), torch.bfloat16, torch.device("cpu"), False)
    assert p.shape == (4, 8) and p.dtype == torch.bfloat16 and not p.requires_grad


def test_a_kept_merge_the_pool_has_no_room_for_takes_the_shared_pool_s_cache_back_then_gives_up(monkeypatch):
    import contextlib

    cache, emptied = MergeCache(1 << 20), []
    cache._pool = object()  # a pool of its own (cuda's; this cpu build cannot make one)
    fails = iter([True, False, True, True])  # each try into the pool: out of memory, or not

    @contextlib.contextmanager
    def pool(_pool, _device):
        if next(fails):
            raise torch.OutOfMemoryError("CUDA out of memory")
        yield

    monkeypatch.setattr(torch.cuda, "use_mem_pool", pool)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    kept = cache.new_parameter((4, 8), torch.bfloat16, torch.device("cpu"), False)
    assert kept is not None and kept.shape == (4, 8) and emptied == [1]  # the second try, after the cache went back
    assert cache.new_parameter((4, 8), torch.bfloat16, torch.device("cpu"), False) is None and emptied == [1, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a torch with cuda makes the pool")
def test_a_torch_without_memory_pools_keeps_merges_in_the_shared_pool(caplog):
    cache = MergeCache(1 << 20, "cuda")  # this cpu build's MemPool is a stand-in that refuses to be made
    assert cache._pool is None
    assert "without a memory pool of its own" in caplog.text


@pytest.mark.parametrize("shape, m, n, want", [
    (DEFAULT_SHAPE, 5120, 5120, (40 * 40, 1)),  # 128 x 128 tiles: one program a tile, each merging one
    (DEFAULT_SHAPE, 63, 5121, (1 * 41, 1)),  # partial tiles count whole
    (KernelShape(64, 128, 4, 132), 13824, 5120, (132, 66)),  # 216 x 40 tiles over 132 programs: 65.45 -> 66
    (KernelShape(64, 128, 4, 132), 100, 200, (4, 1)),  # never more programs than tiles (2 x 2)
    (KernelShape(128, 256, 8, 16), 5120, 13824, (16, 135)),  # 40 x 54 tiles
])
def test_a_kernel_shape_covers_every_tile_once(shape, m, n, want):
    programs, iters = shape.grid(m, n)
    assert (programs, iters) == want
    tiles = -(-m // shape.rows) * -(-n // shape.cols)
    covered = sorted(p + i * programs for p in range(programs) for i in range(iters) if p + i * programs < tiles)
    assert covered == list(range(tiles))  # the kernel's tile = program + i * programs, masked past the last
