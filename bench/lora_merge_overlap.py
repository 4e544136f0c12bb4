"""Where a streamed block's LoRA merges cost their time (issue 29): one Wan2.1-14B block's compute at
the served request's size (832x480x17, CFG in one batch: 2 x 7,800 video tokens, 2 x 512 text
tokens) with its ten merges placed four ways, each merged by peft's two torch steps and by the
one-pass kernel (`dlo.engine.lora.merge_kernel`).

    python3 bench/lora_merge_overlap.py --out $OUT/raw-lora-merge-overlap.json     # one GPU, ~30 s
    python3 bench/lora_merge_overlap.py --dry-run --out /tmp/overlap.json          # cpu, tiny shapes

Served through `dlo serve` (every block streamed, 2026-12-06, one H100) a rank-64 adapter costs
~1.0 ms a block with the kernel and ~1.6 ms with the two steps, where the merges alone take 0.56 and
1.03 ms of device time (`bench/lora_merge_kernel.py`): this bench splits the gap. The ways:
- `base`: the block alone, no adapter;
- `serial`: each layer's merge on the compute stream right before the layer (no overlap: the merge's
  device time plus nothing);
- `ahead`: the engine's `LoraBank` with its `MergeAhead`: the next layer's merge on a side stream
  while the current layer computes (what `dlo serve` runs; `serial` is the same bank without it);
- `upfront`: the block's ten merges on the compute stream at the block's start, into a scratch the
  size of the block (one burst at full bandwidth, then the block's compute undisturbed);
- `ahead_priority`: `ahead` with the compute on a stream of the highest priority, so the side
  stream's merge kernels get SMs only where the compute leaves them free;
- `fused_pN` (`serial` and `ahead`): the kernel on a persistent grid of N programs (an eighth, a
  quarter, half the SMs), so a merge beside a GEMM holds only those SMs.
Per way: `--reps` blocks timed between CUDA events after 3 warm-ups, alternating two weight sets
(the two slots), median kept; its cost is the median less `base`'s. Bytes: every way's block output
is compared with `serial`'s in two torch steps (the same merges, so the same bytes: `same_bits`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wan_bench as wb  # noqa: E402

wb.ensure_dlo_importable()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dlo.engine.lora.ahead import MergeAhead  # noqa: E402
from dlo.engine.lora.bank import LoraBank  # noqa: E402
from dlo.engine.lora.merge import TWO_STEPS, MergeScratch, MergeWay, merge_layer  # noqa: E402
from dlo.engine.lora.merge_kernel import FusedMerge, KernelShape, launch_triton, same_bits  # noqa: E402
from dlo.engine.lora.weights import Branch  # noqa: E402

RANK = 64
# dim, ffn, heads, video tokens a sample, text tokens a sample, batch (CFG)
WAN = {"dim": 5120, "ffn": 13824, "heads": 40, "video": 7800, "text": 512, "batch": 2}
TINY = {"dim": 64, "ffn": 160, "heads": 4, "video": 96, "text": 16, "batch": 2}
LAYERS = ("q1", "k1", "v1", "o1", "q2", "k2", "v2", "o2", "up", "down")  # the order a Wan block runs them
WAYS = ("base", "serial", "ahead", "upfront", "ahead_priority")
PERSISTENT_SM_FRACTIONS = (0.125, 0.25, 0.5)  # `fused_p*`: the kernel on a grid of this share of the SMs, ahead


def layer_shapes(c: dict) -> dict[str, tuple[int, int]]:
    d, f = c["dim"], c["ffn"]
    return {**{n: (d, d) for n in LAYERS[:8]}, "up": (f, d), "down": (d, f)}


class Block:
    """One streamed block's linear layers (the bank's keys), with their own weights."""

    def __init__(self, c: dict, index: int, device: torch.device, gen: torch.Generator, dtype: torch.dtype):
        self.index = index
        self.layers: dict[str, nn.Linear] = {}
        for name, (o, i) in layer_shapes(c).items():
            layer = nn.Linear(i, o, bias=False, device=device, dtype=dtype).requires_grad_(False)
            layer.weight.copy_(torch.randn(o, i, generator=gen, device=device) * i ** -0.5)
            self.layers[name] = layer


def branches(c: dict, device: torch.device, gen: torch.Generator, dtype: torch.dtype) -> dict[str, Branch]:
    """A rank-64 adapter on every layer (random, never zeros), a factor of 1 (alpha = r)."""
    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    return {n: Branch(rand(RANK, i), rand(o, RANK), None, 1.0) for n, (o, i) in layer_shapes(c).items()}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: dict) -> torch.Tensor:
    b, heads = c["batch"], c["heads"]
    split = lambda t: t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2)  # noqa: E731
    return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(q.shape)


Linear = Callable[[torch.Tensor], torch.Tensor]


def forward(x: torch.Tensor, text: torch.Tensor, lin: Callable[[str], Linear], c: dict) -> torch.Tensor:
    """A Wan block's work (norms and modulation left out: they are the same with and without)."""
    h = F.layer_norm(x, x.shape[-1:])
    x = x + lin("o1")(attention(lin("q1")(h), lin("k1")(h), lin("v1")(h), c))
    h = F.layer_norm(x, x.shape[-1:])
    x = x + lin("o2")(attention(lin("q2")(h), lin("k2")(text), lin("v2")(text), c))
    h = F.layer_norm(x, x.shape[-1:])
    return x + lin("down")(F.gelu(lin("up")(h), approximate="tanh"))


class Way:
    """How one block call gets its merged weights: the block's own layers, with the engine's bank
    hooked on them (`serial`, `ahead*`: installed by `time_way` for the whole run, as for a request)
    or none (`base`), or the ten merges made up front into buffers of their own (`upfront`)."""

    def __init__(self, name: str, adapter: dict[str, Branch], blocks: list[Block], device: torch.device,
                 upfront: dict[str, torch.Tensor], way: MergeWay):
        self.name, self.adapter, self.upfront, self.way = name, adapter, upfront, way
        self.bank = bank(adapter, blocks, device, way, name.startswith("ahead")) if name in (
            "serial", "ahead", "ahead_priority") else None

    def run(self, block: Block, x: torch.Tensor, text: torch.Tensor, c: dict) -> torch.Tensor:
        if self.name != "upfront":
            return forward(x, text, lambda n: block.layers[n], c)
        for n, layer in block.layers.items():
            merge_layer((self.upfront[n], None), layer.weight, None, self.adapter[n], None, self.way)
        return forward(x, text, lambda n: lambda t: F.linear(t, self.upfront[n]), c)


def bank(adapter: dict[str, Branch], blocks: list[Block], device: torch.device, way: MergeWay,
         ahead: bool) -> LoraBank:
    """The engine's bank for adapter "a" on every block's layers, each block streamed, merging every
    call; with `ahead`, its look-ahead on a side stream (cuda; at once on cpu)."""
    layers = {blk.layers[n]: adapter[n] for blk in blocks for n in blk.layers}
    streamed = {m: blk.index for blk in blocks for m in blk.layers.values()}
    look = MergeAhead(MergeScratch(adapter.values(), device),
                      torch.cuda.Stream(device) if device.type == "cuda" else None) if ahead else None
    return LoraBank({"a": layers}, add_in_gemm=device.type == "cuda", scratch=MergeScratch(adapter.values(), device),
                    streamed=streamed, way=way, ahead=look)


def time_way(way: Way, blocks: list[Block], x: torch.Tensor, text: torch.Tensor, c: dict, reps: int,
             device: torch.device) -> tuple[float, torch.Tensor]:
    """Median milliseconds a block, and the output of the last block call (from `blocks[0]`)."""
    stream = torch.cuda.Stream(device, priority=-1) if way.name == "ahead_priority" else None
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    hooked = way.bank.applied("a", 1.0) if way.bank is not None else nullcontext()
    with ctx, hooked, torch.inference_mode():
        if stream is not None:
            stream.wait_stream(torch.cuda.default_stream(device))
        for i in range(3):
            way.run(blocks[i % 2], x, text, c)
        times, events = [], []
        for i in range(reps):
            if device.type == "cuda":  # no wait between blocks: the host queues ahead, as it does serving
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                way.run(blocks[i % 2], x, text, c)
                end.record()
                events.append((start, end))
            else:
                t0 = time.perf_counter()
                way.run(blocks[i % 2], x, text, c)
                times.append((time.perf_counter() - t0) * 1e3)
        if events:
            events[-1][1].synchronize()
            times = [start.elapsed_time(end) for start, end in events]
        out = way.run(blocks[0], x, text, c)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(times), out


def persistent_programs(device: torch.device) -> list[int]:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return [max(1, round(sms * f)) for f in PERSISTENT_SM_FRACTIONS]


def measure(c: dict, args: argparse.Namespace, device: torch.device, fused: FusedMerge | None) -> dict:
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(29)
    blocks = [Block(c, i, device, gen, dtype) for i in range(2)]
    adapter = branches(c, device, gen, dtype)
    x = torch.randn(c["batch"] * c["video"], c["dim"], generator=gen, device=device).to(dtype)
    text = torch.randn(c["batch"] * c["text"], c["dim"], generator=gen, device=device).to(dtype)
    upfront = {n: torch.empty(o, i, dtype=dtype, device=device) for n, (o, i) in layer_shapes(c).items()}
    rec: dict = {"config": c, "ways": {}}
    kernels = [("torch", TWO_STEPS, WAYS)]
    if fused is not None:
        kernels.append(("fused", MergeWay(fused=fused), WAYS))
        kernels += [(f"fused_p{p}", MergeWay(fused=FusedMerge(lambda o, w, B, A, f, s=KernelShape(programs=p):
                                                              launch_triton(o, w, B, A, f, s))), ("serial", "ahead"))
                    for p in persistent_programs(device)]
    base_ms, base_out, ref = None, None, None
    for kernel, merge_way, ways in kernels:
        for name in ways if device.type == "cuda" else ways[:-1]:  # no stream priorities on cpu
            if name == "base" and base_ms is not None:
                continue
            way = Way(name, adapter, blocks, device, upfront, merge_way)
            ms, out = time_way(way, blocks, x, text, c, args.reps, device)
            if name == "base":
                base_ms, base_out = ms, out
                rec["ways"]["base"] = {"ms_per_block": round(ms, 4)}
                print(f"base                     {ms:8.3f} ms/block", flush=True)
                continue
            ref = out if ref is None else ref  # torch's serial: every way and kernel gives its bytes
            key = f"{name}_{kernel}"
            rec["ways"][key] = {"ms_per_block": round(ms, 4), "cost_ms": round(ms - base_ms, 4),
                                "ratio": round(ms / base_ms, 4), "same_bytes_as_serial": same_bits(out, ref),
                                "differs_from_base": not same_bits(out, base_out),
                                "ahead_hits": way.bank.ahead.hits if way.bank and way.bank.ahead else None}
            print(f"{key:24s} {ms:8.3f} ms/block  cost {ms - base_ms:7.3f} ms  x{ms / base_ms:.4f}  same bytes as "
                  f"serial: {rec['ways'][key]['same_bytes_as_serial']}", flush=True)
            if way.bank is not None:
                way.bank.close()
            del way
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the raw record (JSON)")
    ap.add_argument("--reps", type=int, default=12, help="timed blocks per way (the median counts)")
    ap.add_argument("--dry-run", action="store_true", help="cpu, tiny shapes, the two torch steps only")
    args = ap.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    fused = FusedMerge.on(device)
    if device.type == "cuda" and fused is None:
        print("no Triton on this machine: no kernel to compare", file=sys.stderr)
        return 2
    rec = {"date": datetime.date.today().isoformat(), "command": " ".join(["python3", *sys.argv]),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rank": RANK,
           "torch": torch.__version__}
    rec["wan2.1-14b"] = measure(TINY if args.dry_run else WAN, args, device, fused)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
