"""A merge in row steps (`dlo.engine.lora.merge.MergeSteps`, [Note: merging in steps]): the same
bytes as one step, whatever the step size, and the steps the size asks for."""

from __future__ import annotations

import pytest
import torch

from dlo.engine.lora import merge
from dlo.engine.lora.bank import LoraBank
from dlo.engine.lora.merge import STEP_ALIGN_ROWS, MergeSteps, merge_weight
from dlo.engine.lora.weights import Branch
from dlo.engine.settings import LORA_MERGE_CHUNK_BYTES, ConfigError, LoraSettings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [None, 0.37])
def test_a_merge_in_steps_equals_one_step_and_runs_the_steps_asked(dtype, factor, monkeypatch):
    torch.manual_seed(5)
    rows, cols, rank = 300, 24, 8
    weight = torch.randn(rows, cols).to(dtype)
    b = Branch(torch.randn(rank, cols).to(dtype), torch.randn(rows, rank).to(dtype), None, 1.0)
    whole = merge_weight(torch.empty_like(weight), weight, b, factor)
    seen = []
    real = merge._merge_rows
    monkeypatch.setattr(merge, "_merge_rows", lambda out, *a: (seen.append(out.shape[0]), real(out, *a)))
    monkeypatch.setattr(merge, "STEP_ALIGN_ROWS", 8)
    row_bytes = cols * weight.element_size()
    # (bytes a step, the rows of each step at 8 rows' alignment): even steps, rounded up to whole 8s
    for step_bytes, expect in ((100 * row_bytes, [104, 104, 92]), (100 * row_bytes + 1, [104, 104, 92]),
                               (5 * row_bytes, [8] * 37 + [4]), (1, [8] * 37 + [4]), (0, [rows]),
                               (10**9, [rows]), (150 * row_bytes, [152, 148])):
        seen.clear()
        got = merge_weight(torch.empty_like(weight), weight, b, factor, MergeSteps(step_bytes))
        assert seen == expect, step_bytes
        assert torch.equal(got, whole), f"{dtype} factor {factor}: {step_bytes} bytes a step changed the merge"


def test_steps_are_whole_tiles_of_the_default_alignment():
    wan_ffn = torch.empty(13824, 5120, dtype=torch.bfloat16)  # 10,240 bytes a row: 819 rows in 8 MiB
    steps = MergeSteps(LORA_MERGE_CHUNK_BYTES)
    assert STEP_ALIGN_ROWS == 128 and steps.rows(wan_ffn) == 896  # 17 even steps of 814 rows, rounded up
    assert steps.rows(torch.empty(64, 5120, dtype=torch.bfloat16)) == 64  # never more than the weight
    assert MergeSteps().rows(wan_ffn) == 13824


def test_the_bank_merges_in_the_steps_its_settings_give(tmp_path):
    assert LoraSettings("/l").merge_chunk_bytes == LORA_MERGE_CHUNK_BYTES == 8 << 20
    assert LoraBank.load(LoraSettings(None), "WanPipeline", tmp_path, None, torch.device("cpu")).steps == MergeSteps()
    assert LoraBank({}, steps=MergeSteps(4096)).steps.rows(torch.empty(1000, 512)) == 128
    with pytest.raises(ConfigError, match="lora merge_chunk_bytes must be an integer >= 0, got -1"):
        LoraSettings("/l", merge_chunk_bytes=-1)
