"""LoRA adapters, the fast parts: the folder's entries, the checks against the model (each refusal
names the file and the key), peft's scaling rule, the branch's op order and the power-of-two fold,
the hooks' lifetime, the request fields, and the torch-free start-up check."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dlo.engine.checkpoint import TensorInfo
from dlo.engine.lora.adapters import AdapterEntry, AdapterError, PeftRule, find_adapters, pattern_key, plan_adapter

# a model with one 2-d linear (out 8, in 6) and a norm
WEIGHTS = {"blocks.0.proj.weight": TensorInfo("blocks.0.proj.weight", "BF16", (8, 6), Path("m"), 0, 96),
           "blocks.0.norm.weight": TensorInfo("blocks.0.norm.weight", "BF16", (8,), Path("m"), 96, 112)}
ENTRY = AdapterEntry("a", Path("/loras/a.safetensors"))


def _plan(shapes: dict, metadata=None, alphas=None):
    return plan_adapter(ENTRY, shapes, {k: "F32" for k in shapes}, metadata, alphas, WEIGHTS)


def _pair(module: str = "blocks.0.proj", r: int = 2, i: int = 6, o: int = 8) -> dict:
    return {f"transformer.{module}.lora_A.weight": (r, i), f"transformer.{module}.lora_B.weight": (o, r)}


def test_a_fitting_adapter_is_planned_with_its_bytes_in_the_layers_dtype():
    plan = _plan(_pair(r=2))
    assert [(m.module, m.rank, m.in_features, m.out_features) for m in plan.modules] == [("blocks.0.proj", 2, 6, 8)]
    assert plan.device_bytes == 2 * (6 + 8) * 2  # bf16 layer: A and B cast to it
    assert plan.rule.scaling("blocks.0.proj") == 1.0  # no metadata, no alphas: alpha = r


def test_what_every_rank_holds_counts_the_merge_scratch_and_its_look_ahead():
    from dlo.engine.lora import rank_device_bytes

    plans = [_plan(_pair(r=2)), _plan(_pair(r=3))]
    assert rank_device_bytes(plans) == sum(p.device_bytes for p in plans) == (2 + 3) * (6 + 8) * 2
    # merge: a scratch of the largest targeted weight (8 x 6 bf16) for all adapters and layers, twice
    assert rank_device_bytes(plans, "merge") == rank_device_bytes(plans) + 2 * 8 * 6 * 2  # scratch and look-ahead
    assert rank_device_bytes([], "merge") == 0
    assert rank_device_bytes(plans, "auto") == rank_device_bytes(plans, "merge")  # auto merges large requests
    assert rank_device_bytes(plans, "merge", 100) == rank_device_bytes(plans, "merge") + 100  # the cache asked
    # no more than both adapters' merges would fill: 2 x (8 x 6) bf16
    assert rank_device_bytes(plans, "merge", 10**6) == rank_device_bytes(plans, "merge") + 2 * 8 * 6 * 2
    assert rank_device_bytes([], "merge", 10**6) == 0  # no adapter: nothing kept


def test_cfg_pairs_count_a_block_s_merges_in_place_of_the_look_ahead():
    from dlo.engine.lora import rank_device_bytes
    from dlo.engine.lora.adapters import block_merges_bytes

    # two blocks of the same two layers (8 x 6 and 4 x 6, bf16), one resident layer outside them
    shapes = {"blocks.0.proj": 8, "blocks.1.proj": 8, "blocks.0.ff": 4, "blocks.1.ff": 4, "proj_out": 8}
    weights, off = {}, 0
    for name, o in shapes.items():
        weights[f"{name}.weight"] = TensorInfo(f"{name}.weight", "BF16", (o, 6), Path("m"), off, off + o * 12)
        off += o * 12
    pairs = {k: v for name, o in shapes.items() for k, v in _pair(name, o=o).items()}
    plans = [plan_adapter(ENTRY, pairs, {k: "F32" for k in pairs}, None, None, weights)]
    assert block_merges_bytes(plans, ("blocks",)) == (8 * 6 + 4 * 6) * 2  # per layer of a block, once
    assert block_merges_bytes(plans, ("other",)) == 0
    scratch = 8 * 6 * 2
    base = sum(p.device_bytes for p in plans)
    assert rank_device_bytes(plans, "merge") == base + 2 * scratch
    assert rank_device_bytes(plans, "merge", kept_blocks=("blocks",)) == base + scratch + (8 * 6 + 4 * 6) * 2
    assert rank_device_bytes(plans, "branch", kept_blocks=("blocks",)) == base  # nothing merges


@pytest.mark.parametrize("shapes, metadata, fragment", [
    (_pair(i=5), None, "do not fit the layer's 6 inputs and 8 outputs"),
    (_pair(o=9), None, "do not fit the layer's 6 inputs and 8 outputs"),
    (_pair("blocks.0.nope"), None, "the transformer has no blocks.0.nope.weight"),
    ({"transformer.blocks.0.norm.lora_A.weight": (2, 8), "transformer.blocks.0.norm.lora_B.weight": (8, 2)}, None,
     "not a linear layer"),
    ({"transformer.blocks.0.proj.lora_A.weight": (2, 6)}, None, "needs both lora_A.weight and lora_B.weight"),
    ({"transformer.blocks.0.proj.lora_A.weight": (2, 6), "transformer.blocks.0.proj.lora_B.weight": (8, 3)}, None,
     "are not (r, in) and (out, r)"),
    ({**_pair(), "text_encoder.layers.0.q.lora_A.weight": (2, 6)}, None, "text-encoder LoRA is not supported"),
    ({"base_model.model.blocks.0.proj.lora_A.weight": (2, 6)}, None, "a peft checkpoint"),
    ({**_pair(), "transformer.blocks.0.proj.lora_magnitude_vector": (8,)}, None, "DoRA adapters are not supported"),
    ({**_pair(), "transformer.blocks.0.proj.hada_w1": (8,)}, None, "not a LoRA weight"),
    ({}, None, "no transformer LoRA weights"),
    (_pair(r=2), {"r": 4, "lora_alpha": 4}, "the metadata says rank 4, the tensors have 2"),
    (_pair(r=2), {"r": 2, "lora_alpha": 2, "use_dora": True}, "DoRA adapters (use_dora) are not supported"),
    (_pair(r=2), {"r": "two"}, "invalid r, lora_alpha"),
    ({**_pair(r=2), "transformer.blocks.0.proj.lora_B.bias": (8,)}, {"r": 2, "lora_alpha": 2}, "peft would drop it"),
    ({**_pair(r=2), "transformer.blocks.0.proj.lora_B.bias": (9,)}, None, "lora_B.bias [9] is not (8,)"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_the_file_and_the_key(shapes, metadata, fragment):
    with pytest.raises(AdapterError) as e:
        _plan(shapes, metadata)
    assert str(e.value).startswith(f"{ENTRY.path}: ") and fragment in str(e.value)


def test_metadata_and_alpha_keys_together_are_refused_as_diffusers_refuses_them():
    with pytest.raises(AdapterError, match="both lora_adapter_metadata and .alpha keys"):
        _plan(_pair(), {"r": 2, "lora_alpha": 1}, {"blocks.0.proj.alpha": 1.0})


def test_peft_scaling_rule():
    # metadata: alpha / r, rsLoRA alpha / sqrt(r), patterns matched at a dot boundary (peft's get_pattern_key)
    rule = PeftRule.from_metadata({"r": 4, "lora_alpha": 2, "alpha_pattern": {"attn.to_q": 6},
                                   "rank_pattern": {"ff.net.2": 8}}, ENTRY.path)
    assert rule.scaling("blocks.1.ff.net.0.proj") == 0.5
    assert rule.scaling("blocks.1.attn.to_q") == 6 / 4 and rule.scaling("blocks.1.xattn.to_q") == 0.5
    assert rule.rank("blocks.1.ff.net.2") == 8 and rule.scaling("blocks.1.ff.net.2") == 2 / 8
    assert PeftRule.from_metadata({"r": 4, "lora_alpha": 2, "use_rslora": True}, ENTRY.path).scaling("x") == 2 / 2
    # no metadata: ranks from the tensors, every module at scale 1.0 even where ranks differ
    mixed = PeftRule.from_tensors({"a.q": 4, "a.k": 4, "a.v": 2}, {}, False)
    assert [mixed.rank(m) for m in ("a.q", "a.k", "a.v")] == [4, 4, 2]
    assert all(mixed.scaling(m) == 1.0 for m in ("a.q", "a.k", "a.v"))
    # Flux's `.alpha` keys: each module its own alpha (the most common one, the rest as a pattern)
    alphas = PeftRule.from_tensors({"a.q": 4, "a.k": 4, "a.v": 4}, {"a.q": 2.0, "a.k": 2.0, "a.v": 3.0}, False)
    assert [alphas.scaling(m) for m in ("a.q", "a.k", "a.v")] == [0.5, 0.5, 0.75]
    assert pattern_key({"^blocks.1.q": 1}, "blocks.1.q") == "^blocks.1.q"
    assert pattern_key({"^blocks.1.q": 1}, "x.blocks.1.q") == "x.blocks.1.q"  # "^": only the whole name


def test_the_folder_entries_files_folders_and_what_is_refused(tmp_path):
    def weights(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")

    weights(tmp_path / "ok" / "b.safetensors")
    weights(tmp_path / "ok" / "c" / "pytorch_lora_weights.safetensors")
    weights(tmp_path / "ok" / "c" / "other.safetensors")  # the diffusers name wins
    weights(tmp_path / "ok" / "d" / "only_one.safetensors")
    weights(tmp_path / "ok" / "d" / "optimizer.safetensors")  # skipped as diffusers skips it
    (tmp_path / "ok" / "README.md").write_text("not an adapter")
    weights(tmp_path / "ok" / ".hidden.safetensors")
    found = {e.name: e.path.name for e in find_adapters(tmp_path / "ok")}
    assert found == {"b": "b.safetensors", "c": "pytorch_lora_weights.safetensors", "d": "only_one.safetensors"}
    cases = {
        "peft": ("adapter_config.json", "a peft adapter folder"),
        "two": ("x.safetensors", "2 weight files"),
        "none": ("notes.txt", "no weight file"),
    }
    for name, (extra, fragment) in cases.items():
        folder = tmp_path / name / "adapter"
        weights(folder / extra)
        if name == "two":
            weights(folder / "y.safetensors")
        with pytest.raises(AdapterError, match=fragment):
            find_adapters(tmp_path / name)
    weights(tmp_path / "dup" / "e.safetensors")
    weights(tmp_path / "dup" / "e" / "pytorch_lora_weights.safetensors")
    with pytest.raises(AdapterError, match="adapter 'e' is also"):
        find_adapters(tmp_path / "dup")
    weights(tmp_path / "badname" / "a:b.safetensors")
    with pytest.raises(AdapterError, match="must be 1-64 letters"):
        find_adapters(tmp_path / "badname")


# ---- the branch --------------------------------------------------------------------------------
def _branch(dtype: torch.dtype, scaling, bias: bool = True, seed: int = 0):
    from dlo.engine.lora.weights import Branch

    g = torch.Generator().manual_seed(seed)
    A = (torch.randn(4, 24, generator=g) / 5).to(dtype)
    B = (torch.randn(40, 4, generator=g) / 50).to(dtype)
    b = (torch.randn(40, generator=g) / 50).to(dtype) if bias else None
    return Branch(A, B, b, scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [0.5, 0.125, 2.0, 5 / 6, 1.0])
def test_the_branch_is_peft_s_op_order_and_a_folded_power_of_two_changes_no_bit(dtype, scaling):
    from dlo.engine.lora.bank import add_branch
    from dlo.engine.lora.weights import _fold

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 24, generator=g).to(dtype)
    out = torch.randn(2, 7, 40, generator=g).to(dtype)
    b = _branch(dtype, scaling)
    peft = out + F.linear(F.linear(x, b.A), b.B, b.bias) * scaling  # lora.Linear.forward, unmerged
    folded = _fold(b)
    assert (folded.scaling == 1.0) == (math.frexp(scaling)[0] == 0.5)  # powers of two only
    factor = None if folded.scaling == 1.0 else folded.scaling
    assert torch.equal(add_branch(out.clone(), x, folded, factor), peft)


def test_the_add_in_b_s_gemm_is_taken_only_where_it_keeps_peft_s_order_of_steps():
    """[Note: the add in B's product]: cuda's path forced on cpu (where its one rounding differs): it
    adds into `out` itself, within rounding of the two-step order, for a strided 3-d input; a
    multiply or a bias keeps the two steps bit for bit."""
    from dlo.engine.lora.bank import add_branch

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 24, generator=g)[:, 1:8].to(torch.bfloat16)  # a sequence's slice: strided, as Flux's to_out
    out = (torch.randn(2, 7, 40, generator=g) / 100).to(torch.bfloat16)
    plain = _branch(torch.bfloat16, 1.0, bias=False)
    two_steps = add_branch(out.clone(), x, plain, None)
    target = out.clone()
    fused = add_branch(target, x, plain, None, add_in_gemm=True)
    assert fused.data_ptr() == target.data_ptr() and fused.shape == (2, 7, 40)
    torch.testing.assert_close(fused, two_steps, rtol=1.6e-2, atol=1e-4)  # one bf16 rounding apart
    assert not torch.equal(fused, two_steps)  # the one-rounding path ran (on cpu it differs somewhere)
    for b, factor in ((plain, 0.8), (_branch(torch.bfloat16, 1.0, bias=True), None)):
        assert torch.equal(add_branch(out.clone(), x, b, factor, add_in_gemm=True), add_branch(out.clone(), x, b, factor))


def test_a_fold_that_would_lose_bits_is_not_made():
    from dlo.engine.lora.weights import _fold

    b = _branch(torch.bfloat16, 2.0 ** -130, bias=False)  # B * 2^-130 leaves bf16's normal range
    assert _fold(b).scaling == 2.0 ** -130


def test_hooks_live_for_one_request_even_when_it_fails():
    from dlo.engine.lora.bank import LoraBank

    layer = torch.nn.Linear(24, 40)
    bank = LoraBank({"a": {layer: _branch(torch.float32, 1.0)}})
    x = torch.randn(3, 24)
    with torch.inference_mode():
        base = layer(x)
        with pytest.raises(RuntimeError, match="boom"), bank.applied("a", 1.0):
            assert not torch.equal(layer(x), base)
            raise RuntimeError("boom")
        assert not layer._forward_hooks and torch.equal(layer(x), base)
        with bank.applied("a", 0.0):  # scale 0: no branch at all, the base layer bit for bit
            assert not layer._forward_hooks and torch.equal(layer(x), base)
        with bank.applied(None):
            assert torch.equal(layer(x), base)
    with pytest.raises(AdapterError, match="no adapter 'b'"), bank.applied("b"):
        pass


# ---- requests and settings ---------------------------------------------------------------------
def _request(**fields):
    from dlo.engine.families.pipelines import PipelineFacts
    from dlo.serving.api_models import ImageGenerationRequest, image_generation
    from dlo.plan.limits import SMALL

    facts = PipelineFacts("wan", "WanPipeline", 16, 4, 5.0, "WanTransformer3DModel")
    body = ImageGenerationRequest(prompt="a cat", size="32x32", seed=1, **fields)
    return image_generation(body, facts, SMALL, "tiny", ("style-a", "style-b"))


def test_a_request_chooses_its_adapter_by_model_id_or_lora_and_bad_choices_are_4xx():
    from dlo.serving.api_models import ApiError

    assert (_request().lora_id, _request().lora_scale) == (None, 1.0)
    assert _request(model="tiny:style-a").lora_id == "style-a"
    assert (_request(lora="style-b", lora_scale=0.5).lora_id, _request(lora="style-b", lora_scale=0.5).lora_scale) \
        == ("style-b", 0.5)
    assert _request(model="tiny:style-a", lora="style-a").lora_id == "style-a"
    for fields, status, param, fragment in [
        ({"model": "tiny:nope"}, 400, "model", "no LoRA adapter 'nope'"),
        ({"lora": "nope"}, 400, "lora", "its adapters: style-a, style-b"),
        ({"model": "tiny:style-a", "lora": "style-b"}, 400, "lora", "name different adapters"),
        ({"lora_scale": 0.5}, 400, "lora_scale", "lora_scale needs an adapter"),
        ({"lora": "style-a", "lora_scale": 11.0}, 400, "lora_scale", "between -10 and 10"),
        ({"lora": "style-a", "lora_scale": 10.0000001}, 400, "lora_scale", "got 10.0000001"),  # not "got 10"
        ({"model": "other:style-a"}, 404, "model", "is not served here"),
    ]:
        with pytest.raises(ApiError) as e:
            _request(**fields)
        assert (e.value.status, e.value.param) == (status, param) and fragment in e.value.message


def test_a_flag_is_no_scale():
    """JSON `true` for lora_scale or guidance_scale is refused (pydantic alone takes it as 1.0)."""
    from pydantic import ValidationError

    from dlo.serving.api_models import ImageGenerationRequest

    for field in ("lora_scale", "guidance_scale"):
        with pytest.raises(ValidationError, match="must be a number, not true or false"):
            ImageGenerationRequest(prompt="a cat", **{field: True})
        assert getattr(ImageGenerationRequest(prompt="a cat", **{field: 2}), field) == 2.0  # an integer is a number


def test_lora_settings_travel_to_the_ranks_whole():
    from dlo.engine.settings import ConfigError, EngineSettings, LoraSettings, OffloadSettings

    s = EngineSettings(OffloadSettings("allgather"), lora=LoraSettings("/loras"))
    assert EngineSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert EngineSettings.from_dict({"offload": {"mode": "resident"}}).lora == LoraSettings()
    with pytest.raises(ConfigError, match="lora load must be one of start"):
        LoraSettings("/loras", load="first-use")  # type: ignore[arg-type]
    merged = EngineSettings(OffloadSettings("allgather"), lora=LoraSettings("/loras", apply="merge"))
    assert EngineSettings.from_dict(json.loads(json.dumps(merged.to_dict()))).lora.apply == "merge"
    with pytest.raises(ConfigError, match="lora apply must be one of auto, branch, merge, got 'fused'"):
        LoraSettings("/loras", apply="fused")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="it needs lora apply 'merge' or 'auto'"):
        LoraSettings("/loras", apply="branch", merge_cache_bytes=10**9)
    assert LoraSettings("/loras", apply="merge", merge_cache_bytes=10**9).merge_cache_bytes == 10**9
    with pytest.raises(ConfigError, match="lora merge_above_tokens must be an integer >= 0, got -1"):
        LoraSettings("/loras", merge_above_tokens=-1)
    auto = LoraSettings("/loras", merge_above_tokens=100)  # the default apply: merge above 100 tokens a call
    assert auto.apply == "auto" and auto.merge_above == 100 and LoraSettings(apply="merge").merge_above == -1
    assert EngineSettings.from_dict(json.loads(json.dumps(EngineSettings(OffloadSettings("resident"), lora=auto).to_dict()))).lora == auto
    assert dataclasses.replace(s, lora=LoraSettings()).lora.directory is None


def test_dlo_serve_checks_a_diffusers_format_adapter_without_importing_torch(tmp_path):
    """The start-up check reads headers only: it runs before the ranks start, at no import cost."""
    from dlo.engine.families.tiny import make_tiny_transformer

    model = tmp_path / "m"
    make_tiny_transformer(model / "transformer", "wan", layers=1)
    A, B = torch.randn(2, 32), torch.randn(32, 2)
    from safetensors.torch import save_file

    (tmp_path / "loras").mkdir()
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": A, "transformer.blocks.0.attn1.to_q.lora_B.weight": B},
              str(tmp_path / "loras" / "q.safetensors"),
              metadata={"lora_adapter_metadata": json.dumps({"transformer.r": 2, "transformer.lora_alpha": 1})})
    code = ("import sys; from dlo.engine.lora import check_adapters; "
            f"p = check_adapters({str(tmp_path / 'loras')!r}, {str(model)!r}, 'WanPipeline'); "
            "print(p[0].name, p[0].rule.scaling('blocks.0.attn1.to_q'), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["q", "0.5", "False"], r.stderr
