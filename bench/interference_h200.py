"""What a weight transfer running beside compute costs the compute, by how it moves bytes (issue 14).

DLO + Ulysses-2 at 480p is compute-bound, yet its allgather mode runs ~1-2% slower than resident
(bench/NOTES.md sections 13-14) and ~2% slower than rank-local at dp2 (section 5's two-GPU record),
while the gathers are hidden (they end long before the next block starts). The hypothesis: an NCCL
AllGather is a kernel, and while its CTAs hold SMs, a persistent GEMM or attention kernel launched
with one CTA per SM waits for them, so compute loses about the whole of the gather's duration,
whatever its CTA count; a copy-engine transfer (H2D, what rank-local does) holds no SM and costs
only memory bandwidth. One GPU can test that without NCCL:

- compute: one Ulysses-2 rank's share of a Wan2.1-14B block at 480p (16,380 tokens through the
  projections and FFN, attention over 32,760 tokens with 20 of 40 heads; bf16), or its GEMMs alone,
  or its attention alone, `--blocks` per timed iteration;
- beside it, on another stream, once per block, `--mb` MB moved by:
  `none`; `h2d` (pinned host to device: copy engine); `d2d` (one same-device memcpy); `sm<k>` (a
  Triton copy kernel of k CTAs, standing in for an NCCL kernel of k channels); started with the
  block, or with `<transfer>@late` once the block's self-attention has finished (the block
  workload only: beside the GEMMs after it, as a gather deferred past attention would run).
  The transfers of a workload run round robin, one iteration each in turn (`none@end`, the last in
  each round, shows what is left of the machine's drift).

Per (workload, transfer): device ms per block (median of `--iters` after warm-up), the transfer's
own ms when it runs alone, and the stall it adds per block, also as a fraction of its own time
(~1 where compute waits out the whole transfer, ~0 where it is hidden).

    python bench/interference_h200.py run --raw $OUT/raw-interference-h200-<date>.json
    python bench/interference_h200.py merge bench/results/raw-interference-h200-<date>.json --tag interference-h200-<date>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

TRANSFERS = ("none", "h2d", "d2d", "sm8", "sm16", "sm32", "sm132", "h2d@late", "sm8@late", "sm16@late",
             "sm32@late", "none@end")
WORKLOADS = ("block", "gemm", "attention")
# one Ulysses-2 rank of Wan2.1-14B at 480p: 32,760 tokens, hidden 5120, FFN 13824, 40 heads of 128
TOKENS, HIDDEN, FFN, HEADS, HEAD_DIM, TEXT = 32760, 5120, 13824, 40, 128, 512


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr, NPROG: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, NPROG * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    return copy


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    bf = torch.bfloat16
    s_local, heads = TOKENS // 2, HEADS // 2
    x = torch.randn(s_local, HIDDEN, device=dev, dtype=bf)
    w = {k: torch.randn(*shape, device=dev, dtype=bf) * 0.02 for k, shape in {
        "qkv": (HIDDEN, 3 * HIDDEN), "o": (HIDDEN, HIDDEN), "cq": (HIDDEN, HIDDEN), "co": (HIDDEN, HIDDEN),
        "up": (HIDDEN, FFN), "down": (FFN, HIDDEN)}.items()}
    q = torch.randn(1, heads, TOKENS, HEAD_DIM, device=dev, dtype=bf)
    k, v = torch.randn_like(q), torch.randn_like(q)
    kt = torch.randn(1, HEADS, TEXT, HEAD_DIM, device=dev, dtype=bf)

    def gemms() -> None:
        h = x @ w["qkv"]
        o = h[:, :HIDDEN] @ w["o"]
        o = (o @ w["cq"]) @ w["co"]
        (o @ w["up"]) @ w["down"]

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v)

    def block(after_attention=None) -> None:
        h = x @ w["qkv"]
        F.scaled_dot_product_attention(q, k, v)
        if after_attention is not None:
            after_attention()
        o = h[:, :HIDDEN] @ w["o"]
        c = (o @ w["cq"]).view(1, s_local, HEADS, HEAD_DIM).transpose(1, 2)
        F.scaled_dot_product_attention(c, kt, kt)
        o = o @ w["co"]
        (o @ w["up"]) @ w["down"]

    work = {"block": block, "gemm": gemms, "attention": attention}
    n_bytes = args.mb * 10**6
    host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    src64, dst64 = src.view(torch.int64), dst.view(torch.int64)
    copy = _copy_kernel()

    def transfer(name: str) -> None:
        if name == "h2d":
            dst.copy_(host, non_blocking=True)
        elif name == "d2d":
            dst.copy_(src)
        elif name.startswith("sm"):
            nprog = int(name[2:])
            copy[(nprog,)](src64, dst64, src64.numel(), BLOCK=2048, NPROG=nprog, num_warps=8)

    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def once(fn, reps: int) -> float:
        """Device ms per call of `reps` calls of fn."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / reps

    def timed(fn, reps: int) -> list[float]:
        """`once` for each of --iters timed iterations, after two warm-up calls."""
        for _ in range(2):
            fn()
        return [once(fn, reps) for _ in range(args.iters)]

    result: dict = {"device_name": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "mb": args.mb, "blocks": args.blocks, "iters": args.iters, "command": sys.argv[1:],
                    "transfer_alone_ms": {}, "ms_per_block": {}}
    for t in ("h2d", "d2d", "sm8", "sm16", "sm32", "sm132"):
        result["transfer_alone_ms"][t] = statistics.median(timed(lambda t=t: transfer(t), 4))
        print(f"{t} alone: {result['transfer_alone_ms'][t]:.3f} ms", flush=True)
    # Round robin: iteration j of every transfer runs before iteration j + 1 of any, so a machine
    # that slows over the call (clocks, heat) shifts every transfer alike.
    for wl in args.workloads.split(","):
        per = result["ms_per_block"][wl] = {}
        steps = {}
        # `none` first: the baseline every stall is measured against
        for t in ["none", *(t for t in args.transfers.split(",") if t != "none")]:
            kind, _, when = t.partition("@")
            if when == "late" and wl != "block":
                continue
            done = torch.cuda.Event()

            def launch(kind=kind, done=done) -> None:
                start = torch.cuda.Event()
                start.record(main)
                side.wait_event(start)  # the transfer starts here on the block's stream order
                with torch.cuda.stream(side):
                    transfer(kind)
                done.record(side)

            def step(kind=kind, when=when, fn=work[wl], launch=launch, done=done) -> None:
                if kind == "none":
                    fn()
                    return
                if when == "late":
                    fn(after_attention=launch)
                else:
                    launch()
                    fn()
                main.wait_event(done)  # the next block waits for this one's weights

            steps[t] = step
        for fn in steps.values():
            fn()
            fn()
        times: dict[str, list[float]] = {t: [] for t in steps}
        for _ in range(args.iters):
            for t, fn in steps.items():
                times[t].append(once(fn, args.blocks))
        for t, ts in times.items():
            per[t] = {"median": statistics.median(ts), "all": ts}
            print(f"{wl} + {t}: {per[t]['median']:.3f} ms per block", flush=True)
    result["summary"] = summarize(result)
    Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
    Path(args.raw).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


def summarize(rec: dict) -> dict:
    """Per workload and transfer: the stall it adds per block (ms) and that over its own time."""
    out: dict = {}
    for wl, per in rec["ms_per_block"].items():
        base = per["none"]["median"]
        out[wl] = {t: {"stall_ms": x["median"] - base,
                       "stall_over_transfer": ((x["median"] - base) / rec["transfer_alone_ms"][t.split("@")[0]]
                                               if not t.startswith("none") else None)}
                   for t, x in per.items() if t != "none"}
    return out


def merge(args: argparse.Namespace) -> None:
    rec = json.loads(Path(args.raw_file).read_text())
    rec["summary"] = summarize(rec)
    lines = [f"# What a transfer beside compute costs the compute: {rec['device_name']}", "",
             f"Merged with `python bench/interference_h200.py merge {args.raw_file} --tag {args.tag}`; one device "
             f"call (`run` command inside). {rec['mb']} MB per transfer (half of a Wan2.1-14B block: one rank's "
             f"share at sp2), one per block, started with the block; medians of {rec['iters']} iterations of "
             f"{rec['blocks']} blocks.", "",
             "| transfer | alone ms | " + " | ".join(f"{wl} ms/block (stall ms, x own time)" for wl in rec["ms_per_block"])
             + " |", "|---|---|" + "---|" * len(rec["ms_per_block"])]
    for t in TRANSFERS:
        if not any(t in per for per in rec["ms_per_block"].values()):
            continue
        cells = []
        for wl, per in rec["ms_per_block"].items():
            s = rec["summary"][wl].get(t)
            if t not in per:
                cells.append("")
                continue
            ratio = "" if s is None or s["stall_over_transfer"] is None else f", {s['stall_over_transfer']:.2f}"
            cells.append(f"{per[t]['median']:.2f}" + ("" if s is None else f" ({s['stall_ms']:+.2f}{ratio})"))
        alone = rec["transfer_alone_ms"].get(t.split("@")[0])
        lines.append(f"| {t} | {'' if alone is None else f'{alone:.2f}'} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(rec, indent=1))
    (out / f"{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one device call on one GPU")
    r.add_argument("--mb", type=int, default=351, help="MB per transfer (default: half a Wan2.1-14B block)")
    r.add_argument("--blocks", type=int, default=8, help="blocks per timed iteration")
    r.add_argument("--iters", type=int, default=5)
    r.add_argument("--workloads", default=",".join(WORKLOADS))
    r.add_argument("--transfers", default=",".join(TRANSFERS))
    r.add_argument("--raw", required=True)
    m = sub.add_parser("merge", help="raw file -> <tag>.{json,md}")
    m.add_argument("raw_file")
    m.add_argument("--tag", required=True)
    m.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    main()
