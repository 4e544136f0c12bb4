"""Peer gathers on CUDA (`DLO_GATHER=peer`, dlo.engine.peergather): bytes and time on the GPUs there are.

Two ranks, each on cuda:(rank % device count): on one GPU both share it (CUDA IPC between two
processes of one device, same-device copies: checks the handshake, the IPC mappings and events, not
the speed); on two, each has its own and the pulls cross NVLink on the copy engines. The ranks join a
gloo group (the setup's object exchanges; peer gathers run no collective). Each rank loads a
Wan2.1-14B-shaped checkpoint resident, then in allgather mode with peer gathers, runs the same inputs
(`--workload`, seeds 1..3) through both and compares the bytes; the per-call seconds of each (after a
warm-up call) are in the raw file.

    bash bench/device.sh python -m bench peer-check --layers 4 --raw $OUT/raw-peer-check-<date>.json
    python -m bench peer-check --tiny --device cpu --layers 3 --raw /tmp/raw-peer.json   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench import _env
from bench import wan_bench as wb
from bench.lib import records

_env.multicast_off()  # before torch: this process and what it spawns
WORLD = 2


def rank_main(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from dlo.engine import OffloadSettings, load

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    res: dict = {"rank": rank, "device": str(dev)}
    shas: dict[str, list[str]] = {}
    for mode in ("resident", "allgather"):
        t0 = time.perf_counter()
        m = load(args.ckpt, settings=OffloadSettings(mode, transfer="peer"), device=dev)
        sync()
        res[f"{mode}_load_seconds"] = time.perf_counter() - t0
        res[f"{mode}_transfer"] = m.report.transfer
        shas[mode], secs = [], []
        with torch.no_grad():
            m.module(**wb.make_inputs(args.workload, str(dev), tiny=args.tiny, seed=1))  # warm-up
            for seed in (1, 2, 3):
                inputs = wb.make_inputs(args.workload, str(dev), tiny=args.tiny, seed=seed)
                sync()
                dist.barrier()
                t1 = time.perf_counter()
                y = m.module(**inputs)[0]
                sync()
                secs.append(time.perf_counter() - t1)
                shas[mode].append(wb.sha256_of(y))
        res[f"{mode}_seconds"] = statistics.median(secs)
        st = m.stats()
        res[f"{mode}_stats"] = {"gathers": st.gathers, "collective_bytes": st.collective_bytes,
                                "gather_wait_seconds": st.gather_wait_seconds}
        m.close()
        del m
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    res["bit_identical"] = shas["resident"] == shas["allgather"]
    res["shas"] = shas
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, res)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench peer-check", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workload", default="image", choices=("image", "video"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions (CPU dry run)")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--raw", required=True)
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    from dlo.engine.ports import free_port

    ckpt, _, facts = wb.checkpoint_for(args.ckpt, args.layers, args.device, args.tiny)
    args.ckpt = str(ckpt)
    tmp = Path("/tmp/peer-check.json")
    tmp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    mp.start_processes(rank_main, args=(free_port(), args, str(tmp)), nprocs=WORLD, start_method="spawn", join=True)
    ranks = json.loads(tmp.read_text())
    result = records.raw("peer-check", args.device, {
        "layers": args.layers, "workload": args.workload,
        "devices": torch.cuda.device_count() if args.device == "cuda" else 0,
        "block_bytes": facts.largest_block_bytes, "ranks": ranks,
        "bit_identical": all(r["bit_identical"] for r in ranks), "seconds": time.perf_counter() - t0})
    records.write(result, Path(args.raw))
    print(json.dumps(result, indent=1))
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
