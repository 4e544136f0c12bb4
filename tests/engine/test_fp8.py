"""FP8 weight streaming: the quantize/dequantize round trip, `dlo quantize`'s folder, and a tiny
model's output bit-identical across every mode and dp within FP8 (and not the bfloat16 output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlo.engine.checkpoint import cached_checkpoint
from dlo.engine.fp8 import E4M3_MAX, MIN_ELEMENTS, scale_name
from dlo.engine import quantize as quantize_mod
from dlo.engine.quantize import dequantize_in_two_kernels, dequantize_into, fused_dequantize, quantize_fp8
from dlo.engine.request import Generation
from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.dist_utils import run_ranks
from tests.engine.inputs import forward
from tests.engine.test_family_pipelines import preset_pipeline

DLO = Path(sys.executable).parent / "dlo"


def test_fp8_round_trip_bounds_each_rows_error_and_keeps_representable_values():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 160, generator=gen) * torch.logspace(-3, 1, 96).unsqueeze(1)).to(torch.bfloat16)
    w[5] = 0  # a row of zeros: zeros back, no division by zero
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (96,)
    assert q.float().abs().max() <= E4M3_MAX
    back = dequantize_into(torch.empty_like(w), q, scale)
    err = (back.float() - w.float()).abs()
    # e4m3 keeps 3 mantissa bits (half a step: 1/16 of the value) down to its smallest normal,
    # 2^-6 x scale, below which its steps are 2^-9 x scale; bfloat16's own rounding on top
    bound = torch.maximum(w.float().abs() / 16, scale.unsqueeze(1) * 2**-10) + w.float().abs() * 2**-8
    assert bool((err <= bound + 1e-30).all()), (err - bound).max()
    assert torch.count_nonzero(back[5]) == 0
    exact = (q.float() * scale.unsqueeze(1)).to(torch.bfloat16)  # already on the FP8 grid: unchanged
    q2, s2 = quantize_fp8(exact)
    assert torch.equal(dequantize_into(torch.empty_like(exact), q2, s2), exact)


def test_the_fused_dequantization_computes_the_two_kernel_forms_bytes():
    """The function `torch.compile` fuses, run eagerly here: the same float32 product rounded once
    (a fused form that multiplied in bfloat16, or rounded twice, would differ in the last bit)."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 96, generator=gen) * torch.logspace(-4, 2, 64).unsqueeze(1)).to(torch.bfloat16)
    q, scale = quantize_fp8(w)
    two = dequantize_in_two_kernels(torch.empty_like(w), q, scale)
    fused_eagerly = torch.empty_like(w)
    quantize_mod._dequantize_fused(fused_eagerly, q, scale)
    assert torch.equal(fused_eagerly, two)
    assert torch.equal(dequantize_into(torch.empty_like(w), q, scale), two)  # cpu: the two kernels


def test_fused_dequantize_is_cuda_only_and_a_failed_compile_falls_back_once(monkeypatch, caplog):
    monkeypatch.setattr(quantize_mod, "_FUSED", {})
    monkeypatch.setitem(sys.modules, "triton", type(sys)("triton"))  # importable, whatever is installed
    assert fused_dequantize("cpu", compile_fn=lambda fn: fn) is None
    calls = []

    def failing(fn):
        calls.append(fn)
        raise RuntimeError("no compiler")

    with caplog.at_level("WARNING"):
        assert fused_dequantize("cuda", compile_fn=failing) is None
        assert fused_dequantize("cuda", compile_fn=failing) is None
    assert len(calls) == 1 and "two kernels" in caplog.text  # compiled (and warned) once per process
    monkeypatch.setattr(quantize_mod, "_FUSED", {})
    assert fused_dequantize("cuda", compile_fn=lambda fn: ("compiled", fn)) == ("compiled", quantize_mod._dequantize_fused)


def test_a_fused_kernel_that_fails_at_its_first_call_falls_back_to_the_same_bytes(monkeypatch, caplog):
    """torch.compile compiles at a shape's first call: a compiler missing on the node fails there,
    and the weight is dequantized by the two kernels instead (the load goes on)."""
    calls = []

    def fails(out, q, scale):
        calls.append(out.shape)
        raise RuntimeError("no C compiler for Triton's launcher")

    monkeypatch.setattr(quantize_mod, "_FUSED", {"cpu": fails})  # as `fused_dequantize` leaves it on cuda
    q, scale = quantize_fp8(torch.randn(32, 48).to(torch.bfloat16))
    with caplog.at_level("WARNING"):
        first = dequantize_into(torch.empty(32, 48, dtype=torch.bfloat16), q, scale)
        second = dequantize_into(torch.empty(32, 48, dtype=torch.bfloat16), q, scale)
    assert torch.equal(first, dequantize_in_two_kernels(torch.empty_like(first), q, scale)) and torch.equal(first, second)
    assert len(calls) == 1 and quantize_mod._FUSED["cpu"] is None and "two kernels from here on" in caplog.text


def _quantized(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Path, Path]:
    from dlo.engine.fp8_folder import quantize_folder

    src = preset_pipeline(tmp_path_factory, name)
    dst = tmp_path_factory.getbasetemp() / f"{name}-fp8"
    if not dst.exists():
        quantize_folder(src, dst, show_progress=False)
    return src, dst


def test_dlo_quantize_writes_an_fp8_folder_beside_the_untouched_components(tmp_path_factory):
    src, dst = _quantized(tmp_path_factory, "tiny-wan2.1-t2v")
    before, after = cached_checkpoint(src / "transformer"), cached_checkpoint(dst / "transformer")
    fp8 = {n for n, i in after.tensors.items() if i.dtype == "F8_E4M3"}
    assert fp8 and all(n.startswith("blocks.") and n.endswith(".weight") for n in fp8)
    for name in fp8:  # each FP8 weight has its scale, one float32 per output row
        scale = after.tensors[scale_name(name)]
        assert scale.dtype == "F32" and scale.shape == (after.tensors[name].shape[0],)
        q = after.view(name).to(torch.bfloat16) * after.view(scale_name(name)).unsqueeze(1)
        ref = quantize_fp8(before.view(name))
        assert torch.equal(after.view(name).view(torch.uint8), ref[0].view(torch.uint8)) and q.shape == ref[0].shape
    kept = set(before.tensors) - fp8
    assert kept == {n for n in after.tensors if n not in fp8 and not n.endswith("_scale")}
    for name in kept:  # norms, biases, embeddings, small tensors: as they were
        small_or_not_linear = len(before.tensors[name].shape) != 2 or before.tensors[name].shape[0] * \
            before.tensors[name].shape[1] < MIN_ELEMENTS or not name.startswith("blocks.")
        assert small_or_not_linear and after.tensors[name].dtype == before.tensors[name].dtype, name
        assert torch.equal(after.view(name), before.view(name))
    for f in (src / "vae").glob("*.safetensors"):  # the other components: hard links, no bytes
        assert (dst / "vae" / f.name).stat().st_ino == f.stat().st_ino
    assert json.loads((dst / "model_index.json").read_text()) == json.loads((src / "model_index.json").read_text())
    again = subprocess.run([str(DLO), "quantize", str(dst), str(dst.parent / "twice"), "--dtype", "fp8"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds FP8 weights" in again.stderr
    assert not (dst.parent / "twice").exists() and not (dst.parent / "twice.partial").exists()
    from dlo.plan.budget import DeviceBudgetError, deployment_memory
    from dlo.plan.limits import SMALL

    with pytest.raises(DeviceBudgetError, match="--stream-dtype fp8"):  # dlo serve refuses it before loading
        deployment_memory(dst, SMALL)
    assert deployment_memory(dst, SMALL, stream_dtype="fp8").transformers["transformer"].dequant_bytes > 0


def _modes(rank: int, world: int, folders: dict[str, str]) -> dict[str, bytes]:
    """Every mode's output of the transformer on this rank, per folder (in-memory or stored FP8)."""
    from dlo.engine import OffloadSettings, load

    out = {}
    for label, path in folders.items():
        for mode, kept, weights in (("allgather", 0, "arena"), ("allgather", 1, "registered"),
                                    ("rank-local", 0, "auto"), ("resident", 0, "auto")):
            if label == "converted" and weights == "registered":
                continue  # converted at load: only the arena holds its FP8 bytes
            m = load(path, settings=OffloadSettings(mode, resident_blocks=kept, weights=weights, stream_dtype="fp8"),
                     device="cpu")
            y = [forward(m.module, "wan", s, torch.bfloat16) for s in range(2)]  # both slots, then wrapped
            out[f"{label} {mode} kept={kept} {weights}"] = b"".join(t.view(torch.uint8).numpy().tobytes() for t in y)
            if mode == "rank-local":
                out[f"{label} h2d bytes per gather"] = m.stats().h2d_bytes // max(1, m.stats().gathers)
            m.close()
    return out


@pytest.mark.slow
def test_fp8_outputs_are_bit_identical_across_modes_and_dp(tmp_path_factory):
    from dlo.engine import load
    from dlo.engine.fp8_folder import quantize_folder
    from tests.engine.serving_helpers import tiny_pipeline

    pipeline = tiny_pipeline(tmp_path_factory, "wan", dtype="bfloat16")
    quantize_folder(pipeline, tmp_path_factory.mktemp("fp8-modes") / "fp8", show_progress=False)
    bf16 = pipeline / "transformer"
    folders = {"converted": str(bf16), "stored": str(tmp_path_factory.getbasetemp() / "fp8-modes0" / "fp8" / "transformer")}
    results = run_ranks(2, _modes, folders, timeout=400)
    outputs = {v for r in results for k, v in r.items() if "h2d" not in k}
    assert len(outputs) == 1, {k: hash(v) for r in results for k, v in r.items()}  # one output: every mode, dp, folder
    base = load(bf16, settings=OffloadSettings("rank-local"), device="cpu")
    plain = b"".join(forward(base.module, "wan", s, torch.bfloat16).view(torch.uint8).numpy().tobytes() for s in range(2))
    assert plain not in outputs  # FP8 was streamed: not the bfloat16 weights
    h2d_bf16 = base.stats().h2d_bytes // base.stats().gathers
    # the linear weights move at one byte each (plus a scale per row): under the bfloat16 bytes; at this
    # size 256-byte alignment of 1 KB tensors takes a share (a full-size block is ~0.5x: record
    # `fp8-dequant-h200-2026-12-01`)
    for label in folders:
        assert results[0][f"{label} h2d bytes per gather"] < 0.7 * h2d_bf16


def test_a_tiny_pipeline_serves_the_same_fp8_bytes_resident_and_streamed(tmp_path_factory):
    from dlo.serving.pipeline import ServingPipeline

    src, dst = _quantized(tmp_path_factory, "tiny-flux.1-dev")
    gen = Generation(kind="image", prompt="a lighthouse", seed=3, width=32, height=32, steps=2, guidance_scale=3.5)
    outs = {}
    for folder, mode, kept in ((dst, "resident", 0), (dst, "rank-local", 1), (src, "rank-local", 0)):
        pipe = ServingPipeline(folder, EngineSettings(OffloadSettings(mode, resident_blocks=kept, stream_dtype="fp8"),
                                                      stream_encoders=True), max_sequence_length=16)
        try:
            outs[(folder.name, mode)] = pipe.run(gen).outputs
        finally:
            pipe.close()
    assert len({tuple(v) for v in outs.values()}) == 1, outs.keys()
    pipe = ServingPipeline(src, EngineSettings(OffloadSettings("rank-local")), max_sequence_length=16)
    try:
        assert pipe.run(gen).outputs != outs[(dst.name, "resident")]
    finally:
        pipe.close()


def _two_weight_block():
    """One block's slot with two FP8 weights and their scales, as `wire_layout` lays them out
    (256-byte aligned), its `DequantPiece`s and each weight's (q, scale)."""
    import torch

    from dlo.engine.fp8 import DequantPiece
    from dlo.engine.quantize import quantize_fp8

    gen = torch.Generator().manual_seed(3)
    shapes, pieces, weights = [(48, 64), (96, 32)], [], []
    slot = torch.zeros(1 << 15, dtype=torch.uint8)
    src, dst = 0, 0
    for n, (rows, cols) in enumerate(shapes):
        q, s = quantize_fp8((torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16))
        scale = src + rows * cols + 256 - (rows * cols) % 256
        slot[src : src + q.numel()] = q.view(torch.uint8).flatten()
        slot[scale : scale + 4 * rows] = s.view(torch.uint8)
        pieces.append(DequantPiece(f"w{n}", (rows, cols), src, scale, dst, "BF16"))
        weights.append((q, s))
        src, dst = scale + 4 * rows + 256 - (4 * rows) % 256, dst + 2 * rows * cols
    return slot, tuple(pieces), weights


class TableKernel:
    """What the one-launch kernel computes, in torch, from the table it is given (the wiring's
    check on a CPU: the table's offsets, the slot's and the buffer's views); `wrong` adds one to a
    weight's first value (a kernel whose bytes differ), `fails` raises at launch."""

    def __init__(self, wrong: bool = False, fails: bool = False):
        self.wrong, self.fails, self.launches = wrong, fails, 0

    def __getitem__(self, grid):
        def launch(q, scales, out, table, WIDTH, ROWS, BLOCK):
            if self.fails:
                raise RuntimeError("no compiler for this device")
            self.launches += 1
            import torch

            for q_off, s_off, o_off, rows, cols in table.view(-1, WIDTH).tolist():
                v = q[q_off : q_off + rows * cols].view(rows, cols).to(torch.float32) * scales[s_off : s_off + rows, None]
                out[o_off : o_off + rows * cols] = v.to(out.dtype).flatten()
                if self.wrong:
                    out[o_off] += 1

        return launch


def test_a_block_dequantized_in_one_launch_gives_dequantize_intos_bytes_and_a_bad_kernel_is_dropped(caplog):
    """`Dequantize` over the one-launch kernel's table (on a CPU, the kernel's arithmetic in torch):
    the same bytes as a weight at a time; a kernel that fails or whose bytes differ is dropped
    (warned once), the block then dequantized a weight at a time with the same bytes."""
    import torch

    from dlo.engine.fp8_kernel import block_table
    from dlo.engine.quantize import dequantize_into
    from dlo.engine.transfers import Dequantize

    slot, pieces, weights = _two_weight_block()
    expected = [dequantize_into(torch.empty(q.shape, dtype=torch.bfloat16), q, s) for q, s in weights]
    table, dtype, rows = block_table(pieces)
    assert (len(table), dtype, rows) == (10, "BF16", 96) and table[:5] == [0, pieces[0].scale // 4, 0, 48, 64]
    assert block_table(()) is None and block_table([pieces[0], pieces[1].__class__(
        **{**pieces[1].__dict__, "dtype": "F16"})]) is None  # mixed compute dtypes: a weight at a time
    for kernel, launches, warned in ((TableKernel(), 2, False), (TableKernel(wrong=True), 1, True),
                                     (TableKernel(fails=True), 0, True)):
        caplog.clear()
        step = Dequantize([pieces], [slot, slot.clone()], torch.device("cpu"), kernel=kernel)
        with caplog.at_level("WARNING"):
            for k in (0, 1):
                step.buffer.zero_()
                step.run(0, k)
                assert all(torch.equal(step.views[0][p.name], e) for p, e in zip(pieces, expected))
        assert kernel.launches == launches and ("one-launch kernel" in caplog.text) == warned, caplog.text
    assert Dequantize([pieces], [slot], torch.device("cpu")).block is None  # no kernel off cuda


def test_mode_auto_asks_the_policy_about_an_fp8_folder_streamed_as_fp8(tmp_path_factory, tmp_path, caplog):
    """`dlo serve FP8_FOLDER --stream-dtype fp8` with the default `--mode auto`: the policy plans with
    the FP8 blocks (it once read the folder as bfloat16, failed, and fell back to the fixed rule)."""
    from tests.engine.serving_helpers import plan_mode as resolve_mode

    _, dst = _quantized(tmp_path_factory, "tiny-wan2.1-t2v")
    frag = tmp_path / "fragment.json"
    frag.write_text(json.dumps({"h2d_bandwidth_bps": 10**10, "collective_bandwidth_bps": 10**9}))
    with caplog.at_level("WARNING"):
        chosen, why = resolve_mode("auto", dst, 2, "cpu", frag, stream_dtype="fp8")
    assert why.startswith("policy: ") and "no answer" not in caplog.text, (why, caplog.text)
