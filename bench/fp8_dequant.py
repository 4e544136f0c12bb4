"""Where FP8 streaming's compute-stream time goes (issue 27): the dequantization of one block's weights.

    python bench/fp8_dequant.py --device cuda --out $OUT --stem fp8-dequant-h200-$(date +%F)   # ~1 min
    python bench/fp8_dequant.py --device cpu --tiny                                           # dry run

One Flux.1-dev double block's linear weights (the widest block the model streams: 340M weights),
FP8 e4m3 with a float32 scale per row, as a streamed block's slot holds them. Timed with CUDA events,
the median of `--repeats` after a warm-up:
- `dequant`: the two-kernel form over the block (`dequantize_in_two_kernels`: FP8 to bfloat16, then
  one multiply in float32 by each row's scale), and its two halves alone (`copy`, `mul`);
- `engine`: what the engine runs (`dequantize_into`: the fused kernel where the device has one) and
  whether its bytes equal the two-kernel form's (added after the first record);
- `bf16_copy`: a plain bfloat16 device copy of the block (what the memory system does at best);
- `fused`: the same arithmetic as one compiled kernel a weight (`torch.compile`, where Triton is
  importable), its compile seconds, and whether its bytes equal `dequantize_into`'s;
- `overlap`: the block's GEMMs at `--tokens` tokens (a stand-in for its compute) alone, the
  dequantization alone, and both at once on two streams: how much of the dequantization a stream
  of its own would hide behind the compute;
- `device_ms` and `host_ms` of each form (added after the second record): the device's time with
  every launch queued behind a spin kernel first (the events then time the kernels, not the host's
  launches), and the host's time to issue them. The events above time whichever is longer: a form
  the host launches slower than the device runs reads as its launch time;
- `triton_weight` and `triton_block`: two Triton kernels, one launch a weight (here) and one launch
  for the whole block (the engine's own path: `transfers.Dequantize` over the block packed as a
  slot, `dlo.engine.fp8_kernel`'s table and kernel), their bytes against `dequantize_into`'s.
Must never: report a figure it did not measure (a variant that cannot run is recorded as skipped).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import wan_bench as wb  # noqa: E402

wb.ensure_dlo_importable()

import torch  # noqa: E402

from dlo.engine.quantize import dequantize_in_two_kernels, dequantize_into, quantize_fp8  # noqa: E402

D = 3072  # Flux.1-dev's width
# (out, in) of one double block's linear weights: image and text attention (q, k, v, out), the two
# MLPs (up, down) and the two modulation linears
FLUX_DOUBLE_BLOCK = [(D, D)] * 8 + [(4 * D, D), (D, 4 * D)] * 2 + [(6 * D, D)] * 2


def block_weights(shapes: list[tuple[int, int]], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for rows, cols in shapes:
        w = (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16)
        q, s = quantize_fp8(w)
        out.append((q.to(device), s.to(device)))
    return out


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn` (CUDA events on cuda, the wall clock elsewhere)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(samples), 4)


def device_and_host_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> dict[str, float]:
    """The device's milliseconds for `fn`'s kernels (launched behind a spin kernel, so none waits
    for the host) and the host's milliseconds to launch them; medians of `repeats`."""
    fn()
    torch.cuda.synchronize(device)
    dev, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # ~25 ms of spinning: every launch below is queued by then
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end))
    return {"device_ms": round(statistics.median(dev), 4), "host_ms": round(statistics.median(host), 4)}


def triton_kernels() -> Any:
    """Triton and the kernel of one launch a weight (None where Triton is not importable; the
    whole block's is the engine's, `dlo.engine.fp8_kernel`)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def weight_kernel(q_ptr, s_ptr, o_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < cols
        scale = tl.load(s_ptr + row)
        q = tl.load(q_ptr + row * cols + c, mask=m)
        tl.store(o_ptr + row * cols + c, (q.to(tl.float32) * scale).to(o_ptr.dtype.element_ty), mask=m)

    return triton, weight_kernel


def engine_slot(block: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, tuple]:
    """The block as a streamed block's slot holds it (each weight's FP8 bytes, then its float32
    scales, every tensor 256-byte aligned) and its `DequantPiece`s (bfloat16 out, packed)."""
    from dlo.engine.fp8 import DequantPiece
    from dlo.engine.layout import align_up

    pieces, at, dst = [], 0, 0
    for n, (q, _) in enumerate(block):
        rows, cols = q.shape
        scale_at = align_up(at + rows * cols)
        pieces.append(DequantPiece(f"w{n}", (rows, cols), at, scale_at, dst, "BF16"))
        at, dst = align_up(scale_at + 4 * rows), align_up(dst + 2 * rows * cols)
    slot = torch.zeros(at, dtype=torch.uint8, device=device)
    for p, (q, s) in zip(pieces, block):
        slot[p.src : p.src + q.numel()] = q.view(torch.uint8).flatten()
        slot[p.scale : p.scale + 4 * s.numel()] = s.view(torch.uint8)
    return slot, tuple(pieces)


def triton_forms(block: list[tuple[torch.Tensor, torch.Tensor]], outs: list[torch.Tensor], device: torch.device,
                 repeats: int) -> dict[str, Any]:
    """`triton_weight` (one launch a weight, over the block's weights as they are) and
    `triton_block` (the engine's `transfers.Dequantize` over the block packed as a slot: its table,
    its views, its one launch), timed both ways."""
    kernels = triton_kernels()
    if kernels is None:
        return {"skipped": "triton not importable"}
    triton, weight_kernel = kernels
    from dlo.engine.fp8_kernel import COLS
    from dlo.engine.transfers import Dequantize

    weight_outs = [torch.empty_like(o) for o in outs]

    def per_weight() -> None:
        for (q, s), o in zip(block, weight_outs):
            weight_kernel[(q.shape[0], triton.cdiv(q.shape[1], COLS))](q, s, o, q.shape[1], BLOCK=COLS)

    slot, pieces = engine_slot(block, device)
    step = Dequantize([pieces], [slot], device)
    block_outs = [step.views[0][p.name] for p in pieces]
    out: dict[str, Any] = {}
    for name, fn, got in (("triton_weight", per_weight, weight_outs),
                          ("triton_block", lambda: step.run(0, 0), block_outs)):
        for o in got:
            o.zero_()
        fn()
        torch.cuda.synchronize(device)
        same = all(torch.equal(g, ref) for g, ref in zip(got, outs))
        out[name] = {"bit_identical": same, **device_and_host_ms(fn, device, repeats),
                     "events_ms": timed(fn, device, repeats)}
        out[name]["device_gb_per_s"] = round(3 * sum(q.numel() for q, _ in block) / out[name]["device_ms"] / 1e6, 1)
    out["triton_block"]["engine_kernel_in_use"] = step.block is not None  # not dropped by its own check
    return out


def fused_dequant(block: list[tuple[torch.Tensor, torch.Tensor]], outs: list[torch.Tensor]) -> dict[str, Any]:
    """One compiled kernel a weight: the same float32 multiply rounded once to bfloat16."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"triton not importable: {exc}"}

    def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (q.to(torch.float32) * s.unsqueeze(1)).to(torch.bfloat16)

    compiled = torch.compile(dequant, dynamic=False)
    t0 = time.perf_counter()
    fused = [compiled(q, s) for q, s in block]
    torch.cuda.synchronize()
    identical = all(torch.equal(f, o) for f, o in zip(fused, outs))
    return {"fn": compiled, "compile_seconds": round(time.perf_counter() - t0, 2), "bit_identical": identical}


def overlap(block: list[tuple[torch.Tensor, torch.Tensor]], outs: list[torch.Tensor], tokens: int,
            device: torch.device, repeats: int, dequant: Callable[[], None]) -> dict[str, float]:
    """The block's GEMMs alone, the dequantization alone, both at once on two streams (ms)."""
    xs = {cols: torch.randn(tokens, cols, device=device, dtype=torch.bfloat16) for _, cols in FLUX_DOUBLE_BLOCK}
    ws = [o.clone() for o in outs]

    def gemms() -> None:
        for w in ws:
            torch.matmul(xs[w.shape[1]], w.t())

    side = torch.cuda.Stream(device)

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dequant()
        gemms()
        torch.cuda.current_stream(device).wait_stream(side)

    g, d, b = timed(gemms, device, repeats), timed(dequant, device, repeats), timed(both, device, repeats)
    return {"gemms_ms": g, "dequant_ms": d, "both_ms": b,
            "hidden_fraction_of_dequant": round((g + d - b) / d, 3) if d else 0.0}


def measure(device: torch.device, tiny: bool, repeats: int, tokens: int) -> dict[str, Any]:
    shapes = [(r // 64, c // 64) for r, c in FLUX_DOUBLE_BLOCK] if tiny else FLUX_DOUBLE_BLOCK
    block = block_weights(shapes, device)
    outs = [torch.empty(q.shape, dtype=torch.bfloat16, device=device) for q, _ in block]
    ref = [torch.empty_like(o) for o in outs]
    weights = sum(q.numel() for q, _ in block)

    def dequant() -> None:
        for (q, s), o in zip(block, outs):
            dequantize_in_two_kernels(o, q, s)

    engine_outs = [torch.empty_like(o) for o in outs]

    def engine() -> None:  # what the engine runs: the fused kernel where the device has one
        for (q, s), o in zip(block, engine_outs):
            dequantize_into(o, q, s)

    def copy_only() -> None:
        for (q, _), o in zip(block, outs):
            o.copy_(q)

    def mul_only() -> None:
        for (_, s), o in zip(block, outs):
            o.mul_(s.unsqueeze(1))

    def bf16_copy() -> None:
        for o, r in zip(outs, ref):
            r.copy_(o)

    rec: dict[str, Any] = {"weights": weights, "fp8_bytes": weights, "bf16_bytes": 2 * weights}
    rec["dequant_ms"] = timed(dequant, device, repeats)
    rec["copy_ms"] = timed(copy_only, device, repeats)
    rec["mul_ms"] = timed(mul_only, device, repeats)
    dequant()
    rec["bf16_copy_ms"] = timed(bf16_copy, device, repeats)
    rec["engine_ms"] = timed(engine, device, repeats)
    rec["engine_bit_identical"] = all(torch.equal(e, o) for e, o in zip(engine_outs, outs))
    # HBM traffic: copy reads 1 B and writes 2 B a weight, mul reads and writes 2 B
    rec["dequant_gb_per_s"] = round(7 * weights / rec["dequant_ms"] / 1e6, 1)
    rec["bf16_copy_gb_per_s"] = round(4 * weights / rec["bf16_copy_ms"] / 1e6, 1)
    if device.type != "cuda":
        rec["fused"] = rec["overlap"] = {"skipped": "needs cuda"}
        return rec
    fused = fused_dequant(block, outs)
    if "fn" in fused:
        fn = fused.pop("fn")
        fused["ms"] = timed(lambda: [fn(q, s) for q, s in block], device, repeats)
        fused["gb_per_s"] = round(3 * weights / fused["ms"] / 1e6, 1)
        fused.update(device_and_host_ms(lambda: [fn(q, s) for q, s in block], device, repeats))
    rec["fused"] = fused
    rec["engine"] = device_and_host_ms(engine, device, repeats)
    rec["two_kernels"] = device_and_host_ms(dequant, device, repeats)
    rec["bf16_copy"] = device_and_host_ms(bf16_copy, device, repeats)
    rec.update(triton_forms(block, outs, device, repeats))
    rec["overlap"] = overlap(block, outs, tokens, device, repeats, dequant)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="1/64 of each width (a dry run)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=4608, help="tokens of the GEMM stand-in (Flux 1024^2: 4096 + 512)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--stem", default="fp8-dequant")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rec = {"date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "block": "flux.1-dev double block" + (" (1/64 widths)" if args.tiny else ""),
           **measure(device, args.tiny, args.repeats, args.tokens)}
    text = json.dumps(rec, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.stem}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
