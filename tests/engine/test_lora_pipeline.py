"""LoRA adapters on the served pipeline, in process: every adapter, format and scale equals plain
diffusers with `load_lora_weights` (peft) for the same seed, bit for bit on the float outputs, with
Wan float32 and Flux bfloat16, resident and streamed (rank-local: the block weights are slot views
bound per block); applied as the unmerged branch it equals peft's forward, merged (`--lora-apply
merge`) it equals diffusers' `fuse_lora`; scale 0 is the base model; no hook, and no merged weight,
outlives its request."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dlo.engine.settings import EngineSettings, LoraSettings, OffloadSettings
from tests.engine.lora_helpers import SEQ

pytestmark = pytest.mark.slow


# `auto` (the default): the tiny requests hold 4 tokens a call, so the default threshold (8,000) adds the
# branch and a threshold of 3 merges; with a merge cache auto merges every request. `fused`: the merge in
# one pass ([Note: merging in one pass]) with a stand-in for the kernel on cpu: one that gives the two
# steps' bytes ("agrees"), one that does not ("differs": checked, and never seen in a merge)
@pytest.mark.parametrize("family,mode,apply,cache,above,fused", [
    ("wan", "resident", "branch", 0, None, None), ("flux", "rank-local", "auto", 0, None, None),
    ("wan", "rank-local", "merge", 0, None, "agrees"), ("flux", "resident", "merge", 10**9, None, "differs"),
    ("wan", "resident", "auto", 0, 3, None), ("flux", "resident", "auto", 10**9, None, None)])
def test_every_adapter_equals_diffusers_load_lora_weights_bit_for_bit(lora_setups, family, mode, apply, cache, above,
                                                                    fused, monkeypatch):
    from dlo.serving.pipeline import ServingPipeline

    s = lora_setups[family]
    lora = LoraSettings(str(s.lora_dir), apply=apply, merge_cache_bytes=cache,
                        **({} if above is None else {"merge_above_tokens": above}),
                        **({} if fused is None else {"merge_kernel": "triton"}))
    kernel = _stand_in_kernel(monkeypatch, fused) if fused else None
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings(mode), lora=lora), max_sequence_length=SEQ)
    if kernel is not None:  # every kind judged at load, before any request
        at_load, judged = kernel.launches, dict(kernel.verdicts)
        assert judged and set(judged.values()) == {fused == "agrees"} and at_load == len(judged)
        merges = _count_merges(monkeypatch)
    assert sorted(pipe.lora.names) == sorted(s.adapters)
    tokens = pipe.facts.call_tokens(s.gen(0))
    assert tokens == 4
    merged = pipe.lora.merges(tokens)
    assert merged == (apply == "merge" or (apply == "auto" and (above is not None or cache > 0)))
    kind = "merge" if merged else "branch"  # which diffusers reference the bytes equal
    linears = [m for m in pipe.model.module.modules() if isinstance(m, torch.nn.Linear)]
    own = {m: m._parameters["weight"] for m in linears}
    reference = "diffusers + peft" + (" + fuse_lora" if merged else "")
    for i, (adapter, scale, seed) in enumerate(s.cases):
        gen = s.gen(i)
        with torch.inference_mode(), pipe.lora.applied(gen.lora_id, gen.lora_scale, tokens):
            out = pipe.pipe(**pipe.pipeline_kwargs(gen))
        got = np.asarray(out.frames if family == "wan" else out.images)
        ref = s.ref_array(i, kind)
        assert np.array_equal(got, ref), (f"{family} {mode} {apply} case {i} {adapter}@{scale}: max difference "
                                          f"{np.abs(got.astype(np.float64) - ref).max():.3g} from {reference}")
        if adapter is not None and (None, 1.0, seed) in s.cases:
            assert not np.array_equal(ref, s.ref_array(s.case(None, 1.0, seed))), f"{adapter} changed nothing"
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in linears), "a LoRA hook outlived its request"
        # a resident layer (every layer outside a streamed block) computes with its own weight again
        streamed = pipe.model.streamed_modules()
        assert all(m._parameters["weight"] is w for m, w in own.items() if m not in streamed), \
            "a merged weight outlived its request"
    if kernel is not None:  # the kernel made every request's merge where it agrees, none where it differs
        assert pipe.lora.way.fused is kernel and kernel.verdicts == judged and merges
        assert kernel.launches - at_load == (len(merges) if fused == "agrees" else 0)
    if cache:  # every (adapter, scale) asked kept its merges: the request below swaps them in, no merge
        assert set(pipe.lora.cache.keys) == {(a, sc) for a, sc, _ in s.cases if a is not None}
        assert 0 < pipe.lora.cache.used <= cache
        monkeypatch.setattr("dlo.engine.lora.merge.merge_weight", _no_merge)
    # the request path (`run`): the served bytes of the reference, and scale 0 the base model's
    first = next(i for i, c in enumerate(s.cases) if c[0] is not None and c[1] == 1.0)
    assert pipe.run(s.gen(first)).outputs[0] == s.ref_bytes(first, kind)
    base = s.case(None, 1.0, s.cases[first][2])
    assert pipe.run(dataclasses.replace(s.gen(first), lora_scale=0.0)).outputs[0] == s.ref_bytes(base)
    assert pipe.component_reports()["lora"]["device_bytes"] == pipe.lora.device_bytes > 0
    assert (pipe.lora.scratch is not None) == (apply != "branch")
    pipe.close()


def _count_merges(monkeypatch) -> list[int]:
    """Every weight merged from now on (one entry each)."""
    from dlo.engine.lora import merge

    seen: list[int] = []
    real = merge.merge_weight
    monkeypatch.setattr(merge, "merge_weight", lambda *a, **k: (seen.append(1), real(*a, **k))[1])
    return seen


def _stand_in_kernel(monkeypatch, how: str):
    """The bank's fused merge, on cpu for any dtype and rank: the two steps (`agrees`), or the two steps
    plus one (`differs`: a kernel whose sums were ordered otherwise, made obvious)."""
    from dlo.engine.lora import bank
    from dlo.engine.lora.merge_steps import two_steps
    from dlo.engine.lora.merge_kernel import FusedMerge

    def launch(out, w, B, A, f):
        two_steps(out, w, B, A, f)
        if how == "differs":
            out.add_(1)

    kernel = FusedMerge(launch, device_type="cpu", dtypes=(torch.float32, torch.bfloat16), ranks=None)
    monkeypatch.setattr(bank.FusedMerge, "on", classmethod(lambda cls, device: kernel))
    return kernel


def _no_merge(*_args, **_kw):
    raise AssertionError("a cached adapter's request merged a weight")


def test_the_merged_weight_is_the_layer_s_own_again_after_a_forward_that_raises():
    """A layer that raises skips its post-hook: the request's way out puts every weight back, and no
    merge ever writes into the weight itself (the next request's base)."""
    from dlo.engine.lora.bank import LoraBank
    from dlo.engine.lora.weights import Branch

    torch.manual_seed(0)
    good, bad = torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)
    before = good.weight.detach().clone(), bad.weight.detach().clone()

    def branch(layer: torch.nn.Linear) -> Branch:
        return Branch(torch.randn(2, layer.in_features), torch.randn(layer.out_features, 2), None, 0.5)

    adapters = {"a": {good: branch(good), bad: branch(bad)}}
    from dlo.engine.lora.merge import MergeScratch

    bank = LoraBank(adapters, scratch=MergeScratch(adapters["a"].values(), torch.device("cpu")))
    own = good._parameters["weight"], bad._parameters["weight"]
    with torch.inference_mode(), bank.applied("a"):
        y = good(torch.randn(3, 8))
        expected = torch.randn(3, 8)
        b = adapters["a"][good]
        ref = torch.nn.functional.linear(expected, before[0] + (b.B @ b.A) * 0.5, good.bias)
        assert torch.equal(good(expected), ref)  # W + scaling * B A, as peft merges in float32
    assert y.shape == (3, 6)
    with pytest.raises(RuntimeError), torch.inference_mode(), bank.applied("a"):
        bad(torch.randn(3, 5))  # wrong width: raises inside the layer, after its weight was swapped
    assert good._parameters["weight"] is own[0] and bad._parameters["weight"] is own[1]
    with torch.inference_mode(), bank.applied("a"):  # the raise caught inside the forward, the layer called again
        with pytest.raises(RuntimeError):
            bad(torch.randn(3, 5))
        b = adapters["a"][bad]
        x = torch.randn(3, 6)
        assert torch.equal(bad(x), torch.nn.functional.linear(x, before[1] + (b.B @ b.A) * 0.5, bad.bias))
    assert torch.equal(good.weight, before[0]) and torch.equal(bad.weight, before[1])
    assert not bad._forward_pre_hooks and not bad._forward_hooks


def test_the_merge_cache_keeps_what_fits_drops_the_least_recently_used_and_changes_no_bit():
    """Three layers, two adapters, a cache with room for one adapter's merges: each request equals the
    uncached merge bit for bit, whichever of its layers were cached; the other adapter's merges go
    first; a layer marked streamed (its weight this call's slot) is never cached."""
    from dlo.engine.lora.bank import LoraBank
    from dlo.engine.lora.merge import MergeCache, MergeScratch
    from dlo.engine.lora.weights import Branch

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 4))
    for p in model.parameters():
        p.requires_grad_(False)
    streamed = {model[2]: 0}
    adapters = {name: {layer: Branch(torch.randn(2, layer.in_features), torch.randn(layer.out_features, 2), None, 0.5)
                       for layer in model} for name in ("a", "b")}
    one_adapter = sum(layer.weight.numel() * 4 for layer in model[:2])  # float32 weights of the resident two
    branches = [b for br in adapters.values() for b in br.values()]

    def bank(cache: MergeCache | None) -> LoraBank:
        return LoraBank(adapters, scratch=MergeScratch(branches, torch.device("cpu")), cache=cache, streamed=streamed)

    x = torch.randn(5, 8)
    plain, cached = bank(None), bank(MergeCache(one_adapter))
    with torch.inference_mode():
        def run(b: LoraBank, name: str, scale: float = 1.0) -> torch.Tensor:
            with b.applied(name, scale):
                return model(x)

        for name, scale, keys in (("a", 1.0, [("a", 1.0)]), ("a", 1.0, [("a", 1.0)]), ("b", 1.0, [("b", 1.0)]),
                                  ("a", 0.5, [("a", 0.5)]), ("b", 1.0, [("b", 1.0)])):
            assert torch.equal(run(cached, name, scale), run(plain, name, scale)), (name, scale)
            assert list(cached.cache.keys) == keys and cached.cache.used == one_adapter
        assert model[2] not in cached.cache.entries(("b", 1.0))  # streamed: merged in the scratch each call
        small = bank(MergeCache(one_adapter - 1))  # room for the first layer's merge only
        assert torch.equal(run(small, "a"), run(plain, "a")) and list(small.cache.entries(("a", 1.0))) == [model[0]]
        # a layer larger than the whole cache drops nothing for it: "a" keeps its one merge
        tiny = bank(MergeCache(model[1].weight.numel() * 4))
        run(tiny, "a")
        assert torch.equal(run(tiny, "b"), run(plain, "b"))  # layer 0 (192 bytes) never fits 144: b caches layer 1
        assert list(tiny.cache.keys) == [("b", 1.0)] and list(tiny.cache.entries(("b", 1.0))) == [model[1]]
        # a cached request merges only its streamed layer
        calls = []
        real = merge_weight_spy(calls)
        expected = run(plain, "b")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("dlo.engine.lora.merge.merge_weight", real)
            assert torch.equal(run(cached, "b"), expected)
        assert calls == [model[2].out_features], calls
    assert all(layer._parameters["weight"] is not None and not layer._forward_pre_hooks for layer in model)


def merge_weight_spy(calls: list):
    """`merge_weight` that records each merged weight's rows (which layer merged) in `calls`."""
    from dlo.engine.lora.merge import merge_weight

    def spy(out, weight, *args, **kw):
        calls.append(weight.shape[0])
        return merge_weight(out, weight, *args, **kw)

    return spy
