"""CUDA path check: a Wan-shaped model (real dims, 8 layers, random bf16 weights written on the
device) loaded in allgather (world 1), rank-local (arena and registered page cache) and resident;
outputs must be bit-identical. Prints H2D GB/s, slot and host bytes.

    python bench/cuda_check.py [--layers 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _env  # noqa: E402
import wan_bench as wb  # noqa: E402

SYSTEMS = ["resident", "dlo_allgather", "dlo_rank_local_arena", "dlo_rank_local_registered"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    wb.ensure_dlo_importable()
    _env.multicast_off()  # before torch: this process and its children
    ckpt = args.ckpt or f"/tmp/wan14b-{args.layers}{'-tiny' if args.tiny else ''}"
    if not args.ckpt:
        wb.write_wan_checkpoint(Path(ckpt), args.layers, args.device, tiny=args.tiny)
    rows = {}
    for system in SYSTEMS:
        rfile = Path(f"/tmp/cuda-check-{system}.json")
        cmd = [sys.executable, str(HERE / "offload_h200.py"), "--child", system, "--result", str(rfile),
               "--ckpt", ckpt, "--device", args.device, "--workloads", "image", "--iters", "3",
               "--layers", str(args.layers)] + (["--tiny"] if args.tiny else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"{system}: FAILED\n{proc.stderr[-2000:]}")
            return 1
        rows[system] = json.loads(rfile.read_text())
    # two processes registering the same page cache at once: both must load and compute correctly
    procs, files = [], []
    for i in range(2):
        rfile = Path(f"/tmp/cuda-check-twin{i}.json")
        files.append(rfile)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "offload_h200.py"), "--child", "dlo_rank_local_registered", "--result",
             str(rfile), "--ckpt", ckpt, "--device", args.device, "--workloads", "image", "--iters", "2",
             "--layers", str(args.layers)] + (["--tiny"] if args.tiny else []), stderr=subprocess.PIPE, text=True))
    for i, pr in enumerate(procs):
        _, err = pr.communicate()
        if pr.returncode:
            print(f"twin {i}: FAILED\n{err[-2000:]}")
            return 1
        rows[f"twin{i}_registered"] = json.loads(files[i].read_text())
    ref = rows["resident"]["workloads"]["image"]["sha256"]
    lines = [f"# CUDA path check ({dt.date.today().isoformat()})", "",
             f"`python bench/cuda_check.py --layers {args.layers}`: Wan2.1-14B dims, {args.layers} layers, bf16.",
             f"Pinned H2D: {rows['resident'].get('h2d_bandwidth_bps', float('nan')) / 1e9:.1f} GB/s", "",
             "| mode | weights source | ms/call (4,096 tok) | slot bytes | host pinned bytes | resident bytes | ready s | bit-equal |",
             "|---|---|---|---|---|---|---|---|"]
    ok = True
    for system, r in rows.items():
        rep = r["report"]
        same = r["workloads"]["image"]["sha256"] == ref
        ok &= same
        lines.append(f"| {system} | {rep['weights_source']} | {r['workloads']['image']['call_ms']:.1f} | "
                     f"{rep['slot_bytes']} | {rep['host_pinned_bytes']} | {rep['resident_bytes']} | "
                     f"{r['ready_seconds']:.2f} | {same} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cuda-check-{dt.date.today().isoformat()}.md").write_text(text)
    (out / f"cuda-check-{dt.date.today().isoformat()}.json").write_text(json.dumps(rows, indent=1))
    if not ok:
        print("MISMATCH: an offload mode differs from resident")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
