"""LoRA adapters on the served pipeline, in process: every adapter, format and scale equals plain
diffusers with `load_lora_weights` (peft) for the same seed, bit for bit on the float outputs, with
Wan float32 resident and Flux bfloat16 streamed (rank-local: the block weights are slot views bound
per block); scale 0 is the base model; no hook outlives its request."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dlo.engine.settings import EngineSettings, LoraSettings, OffloadSettings
from tests.engine.lora_helpers import SEQ

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family,mode", [("wan", "resident"), ("flux", "rank-local")])
def test_every_adapter_equals_diffusers_load_lora_weights_bit_for_bit(lora_setups, family, mode):
    from dlo.engine.serving.pipeline import ServingPipeline

    s = lora_setups[family]
    pipe = ServingPipeline(s.model, EngineSettings(OffloadSettings(mode), lora=LoraSettings(str(s.lora_dir))),
                           max_sequence_length=SEQ)
    assert sorted(pipe.lora.names) == sorted(s.adapters)
    linears = [m for m in pipe.model.module.modules() if isinstance(m, torch.nn.Linear)]
    for i, (adapter, scale, seed) in enumerate(s.cases):
        gen = s.gen(i)
        with torch.inference_mode(), pipe.lora.applied(gen.lora_id, gen.lora_scale):
            out = pipe.pipe(**pipe._call_kwargs(gen))
        got = np.asarray(out.frames if family == "wan" else out.images)
        ref = s.ref_array(i)
        assert np.array_equal(got, ref), (f"{family} {mode} case {i} {adapter}@{scale}: max difference "
                                          f"{np.abs(got.astype(np.float64) - ref).max():.3g} from diffusers + peft")
        if adapter is not None and (None, 1.0, seed) in s.cases:
            assert not np.array_equal(ref, s.ref_array(s.case(None, 1.0, seed))), f"{adapter} changed nothing"
        assert not any(m._forward_hooks for m in linears), "a LoRA hook outlived its request"
    # the request path (`run`): the served bytes of the reference, and scale 0 the base model's
    first = next(i for i, c in enumerate(s.cases) if c[0] is not None and c[1] == 1.0)
    assert pipe.run(s.gen(first)).outputs[0] == s.ref_bytes(first)
    base = s.case(None, 1.0, s.cases[first][2])
    assert pipe.run(dataclasses.replace(s.gen(first), lora_scale=0.0)).outputs[0] == s.ref_bytes(base)
    assert pipe.component_reports()["lora"]["device_bytes"] == pipe.lora.device_bytes > 0
    pipe.close()
