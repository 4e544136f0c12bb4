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


@pytest.mark.parametrize("family,mode,apply", [("wan", "resident", "branch"), ("flux", "rank-local", "branch"),
                                               ("wan", "rank-local", "merge"), ("flux", "resident", "merge")])
def test_every_adapter_equals_diffusers_load_lora_weights_bit_for_bit(lora_setups, family, mode, apply):
    from dlo.engine.serving.pipeline import ServingPipeline

    s = lora_setups[family]
    lora = LoraSettings(str(s.lora_dir), apply=apply)
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings(mode), lora=lora), max_sequence_length=SEQ)
    assert sorted(pipe.lora.names) == sorted(s.adapters)
    linears = [m for m in pipe.model.module.modules() if isinstance(m, torch.nn.Linear)]
    own = {m: m._parameters["weight"] for m in linears}
    reference = "diffusers + peft" + (" + fuse_lora" if apply == "merge" else "")
    for i, (adapter, scale, seed) in enumerate(s.cases):
        gen = s.gen(i)
        with torch.inference_mode(), pipe.lora.applied(gen.lora_id, gen.lora_scale):
            out = pipe.pipe(**pipe._call_kwargs(gen))
        got = np.asarray(out.frames if family == "wan" else out.images)
        ref = s.ref_array(i, apply)
        assert np.array_equal(got, ref), (f"{family} {mode} {apply} case {i} {adapter}@{scale}: max difference "
                                          f"{np.abs(got.astype(np.float64) - ref).max():.3g} from {reference}")
        if adapter is not None and (None, 1.0, seed) in s.cases:
            assert not np.array_equal(ref, s.ref_array(s.case(None, 1.0, seed))), f"{adapter} changed nothing"
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in linears), "a LoRA hook outlived its request"
        if mode == "resident":  # a resident layer computes with its own weight again, untouched
            assert all(m._parameters["weight"] is w for m, w in own.items()), "a merged weight outlived its request"
    # the request path (`run`): the served bytes of the reference, and scale 0 the base model's
    first = next(i for i, c in enumerate(s.cases) if c[0] is not None and c[1] == 1.0)
    assert pipe.run(s.gen(first)).outputs[0] == s.ref_bytes(first, apply)
    base = s.case(None, 1.0, s.cases[first][2])
    assert pipe.run(dataclasses.replace(s.gen(first), lora_scale=0.0)).outputs[0] == s.ref_bytes(base)
    assert pipe.component_reports()["lora"]["device_bytes"] == pipe.lora.device_bytes > 0
    assert (pipe.lora.scratch is not None) == (apply == "merge")
    pipe.close()


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
    assert torch.equal(good.weight, before[0]) and torch.equal(bad.weight, before[1])
    assert not bad._forward_pre_hooks and not bad._forward_hooks
