"""A LoRA merge in row steps on the device (issue 29, [Note: merging in steps] in
`dlo.engine.lora.merge`): for every adapted layer shape of a Wan2.1-14B and a Flux.1-dev block, the
merge of a rank-64 adapter (`merge_weight`, peft's two steps) in one step and in steps of several
sizes: the milliseconds a block's merges take, the HBM bytes an element they imply, and whether every
step size gives the bytes of one step (what the engine's bit-identity rests on).

    python3 bench/lora_merge_steps.py --out $OUT/raw-lora-merge-steps.json      # one GPU, ~30 s
    python3 bench/lora_merge_steps.py --dry-run --out /tmp/merge-steps.json     # cpu, tiny shapes: every step

Each variant: the block's layers merged in turn into one scratch (as the bank does), 3 warm-ups, then
`--reps` timed blocks between CUDA events, the median kept; the weights are the block's own (a Wan2.1
block's ten weights are 702 MB, far past the L2, as a streamed block's slot is). Bytes: the first merge
of each layer at each step size against its one-step merge (`torch.equal`), for a factor of None (a
power-of-two scale folded into B) and 0.8.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wan_bench as wb  # noqa: E402

wb.ensure_dlo_importable()

import torch  # noqa: E402

from dlo.engine.lora.merge import MergeSteps, merge_weight  # noqa: E402
from dlo.engine.lora.weights import Branch  # noqa: E402

RANK = 64
MiB = 1 << 20
# (out, in) of every adapted linear of one block, in the order the block runs them
BLOCKS = {
    "wan2.1-14b": [(5120, 5120)] * 8 + [(13824, 5120), (5120, 13824)],
    "flux.1-dev-double": [(3072, 3072)] * 8 + [(12288, 3072), (3072, 12288)] * 2,
}
TINY = {"tiny": [(64, 32)] * 4 + [(256, 64), (64, 256)]}
CHUNKS = [0, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB]


def block_layers(shapes: list[tuple[int, int]], device: torch.device, gen: torch.Generator) -> list[tuple]:
    """Each layer's (weight, Branch) in bfloat16, random (never zeros: they time and compare too kindly)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    return [(rand(o, i), Branch(rand(RANK, i) * 0.05, rand(o, RANK) * 0.05, None, 1.0)) for o, i in shapes]


def merge_block(layers: list[tuple], out: torch.Tensor, factor, steps: MergeSteps) -> None:
    for w, b in layers:
        merge_weight(out[:w.numel()].view(w.shape), w, b, factor, steps)


def time_block(layers: list[tuple], out: torch.Tensor, factor, steps: MergeSteps, reps: int,
               device: torch.device) -> float:
    """Median milliseconds of one block's merges."""
    for _ in range(3):
        merge_block(layers, out, factor, steps)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            merge_block(layers, out, factor, steps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            merge_block(layers, out, factor, steps)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def differing_layers(layers: list[tuple], factor, steps: MergeSteps) -> list[str]:
    """The layers (as "OUTxIN") whose merge in `steps` differs from their merge in one step."""
    bad = []
    for w, b in layers:
        one = merge_weight(torch.empty_like(w), w, b, factor)
        got = merge_weight(torch.full_like(w, float("nan")), w, b, factor, steps)
        if not torch.equal(one, got):
            bad.append("x".join(map(str, w.shape)))
    return bad


def measure(name: str, shapes: list[tuple[int, int]], args: argparse.Namespace, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(29)
    layers = block_layers(shapes, device, gen)
    out = torch.empty(max(o * i for o, i in shapes), dtype=torch.bfloat16, device=device)
    elements = sum(o * i for o, i in shapes)
    rec: dict = {"shapes": ["x".join(map(str, s)) for s in shapes], "elements": elements, "variants": {}}
    for chunk in CHUNKS:
        steps = MergeSteps(chunk)
        for factor in (None, 0.8):
            ms = time_block(layers, out, factor, steps, args.reps, device)
            key = f"chunk_{chunk // MiB}MiB_factor_{factor}"
            rec["variants"][key] = {
                "chunk_bytes": chunk, "factor": factor, "ms_per_block": round(ms, 4),
                "rows_per_step": {s: steps.rows(w) for s, (w, _) in zip(rec["shapes"], layers)},
                # the HBM bandwidth a block's merges would need at 4 (W read, sum written) and 8 bytes an element
                "gb_s_at_4_bytes": round(4 * elements / ms / 1e6, 1), "gb_s_at_8_bytes": round(8 * elements / ms / 1e6, 1),
                "differs_from_one_step": differing_layers(layers, factor, steps) if chunk else [],
            }
            print(f"{name:20s} {key:26s} {ms:8.3f} ms/block  at 4 B/el {4 * elements / ms / 1e6:7.1f} GB/s  "
                  f"differs: {rec['variants'][key]['differs_from_one_step']}", flush=True)
    del layers, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the raw record (JSON)")
    ap.add_argument("--reps", type=int, default=20, help="timed blocks per variant (the median counts)")
    ap.add_argument("--dry-run", action="store_true", help="cpu, tiny shapes: every step, no figure")
    args = ap.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    rec: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(["python3", *sys.argv]),
                 "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rank": RANK,
                 "torch": torch.__version__, "blocks": {}}
    for name, shapes in (TINY if args.dry_run else BLOCKS).items():
        rec["blocks"][name] = measure(name, shapes, args, device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
