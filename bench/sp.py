"""Sequence parallelism composed with offload (issue 14): one request over 2 GPUs, weights streamed.

One device call = one `run` (about 2 minutes at 16 Wan2.1-14B layers on 2 H200s):

    python -m bench sp run --layers 16 --raw $OUT/raw-sp.json [--serve]
    python -m bench sp merge bench/results/raw-h200x2-sp.json --tag h200x2-sp-2026-11-30
    python -m bench sp run --tiny --device cpu --layers 3 --raw /tmp/raw-sp.json --serve   # dry run
    # the same, the weight gathers also on their own communicator capped at 4 CTAs (`<config>@ctasN`)
    python -m bench sp run --layers 40 --workloads video --raw $OUT/raw-sp-ctas.json \
        --configs one_gpu_resident,resident_ulysses2,dlo_allgather_ulysses2,dlo_allgather_ulysses2@ctas4
    # DLO's Ulysses exchanges (@lean, @overlap) against diffusers' Ulysses, same call
    python -m bench sp run --layers 40 --workloads video --raw $OUT/raw-sp-lean.json \
        --configs one_gpu_resident,resident_ulysses2,resident_ulysses2@lean,dlo_allgather_ulysses2,dlo_allgather_ulysses2@lean

`run` writes the checkpoint once (seeded, bench/wan_bench.py), then starts one process group per
configuration, each loading the model once:
- `one_gpu_resident` (1 rank): the baseline; its seed-1 outputs are the reference;
- `resident_ulysses2` (2 ranks): resident + diffusers context parallelism (Ulysses-2);
- `dlo_allgather_ulysses2` (2 ranks): DLO allgather over both ranks (each holds half of every block)
  + Ulysses-2 on the same model: one request on both ranks;
- `dlo_allgather_dp2` (2 ranks): DLO allgather without sp, a wave of two requests (seed 1 + rank);
- `dlo_ranklocal_ulysses2` (2 ranks): DLO rank-local (each rank copies whole blocks from the shared,
  DMA-registered page cache: no weight collective) + Ulysses-2, the mode `dlo plan` picks for 480p
  video when the model cannot be resident (compute-bound: a near-tie goes to rank-local);
- `<config>@ctasN`: the same with `DLO_GATHER_MAX_CTAS=N` (the weight gathers on their own NCCL
  communicator capped at N CTAs); the summary's `sp2_over_resident_ulysses2_video_capped` has them.
- `<config>@peer` (allgather ones, after any exchange tag): `DLO_GATHER=peer`, each rank copies the
  other's shards out of its slots (copy engines, no SM) instead of NCCL's AllGather kernel
  (dlo.engine.peergather); summary `peer_over_collective_video`;
- `<config>@lean` / `@overlap`: Wan's self-attention through dlo.engine.ulysses (`DLO_ULYSSES=lean`:
  rotary embedding into the send buffers, attention's output exchanged back token-major;
  `overlap`: also q/k/v exchanged while projecting) instead of diffusers' Ulysses (plain names;
  summary `lean_over_default_video`, `overlap_over_default_video`). Records before 2026-12-01 ran
  `@overlap` as it was then: the input exchanges overlapped, without the lean parts. Two raw files
  of 2026-11-30 ran while that was the default (`@stock`
  then meant diffusers'); `merge` reads them under today's names (`normalized`).
`--profile` adds one call per configuration under the torch profiler: device ms per kernel
category in the raw record, each rank's top kernels in `profile-*.txt` beside it.
Per configuration and workload (480p video 32,760 tokens; image-like 4,096 tokens): seconds per
transformer call (median of >= 3 after a warm-up call), rank 0's seed-1 output against the one-GPU
reference (bit-identical, else max abs difference and PSNR). `dlo plan` per workload and layout
(dp2: --dp 2 at the workload's tokens; sp2: --dp 1 --sp 2 at half of them) gives the estimated block
time (its allgather estimate); sp2 wins while its throughput is within 10% of dp2's (one request
then finishes about twice as soon), else dp2; the measured winner uses the same rule. `--serve` also runs `dlo serve --sp 2` and `--sp 1` on a
tiny pipeline and compares the PNG bytes the openai SDK receives. `merge` writes the record
`<tag>.{json,md}` with its `summary`. NVLink multicast stays off for every process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import ranks as br  # NVLink multicast off for this process and its ranks
from bench import multi_gpu as mb
from bench import wan_bench as wb
from bench.lib import records
from bench.sp_record import CONFIGS, DLO_ULYSSES_VERSION, ITERS, TOKENS, merge, split_config, summarize

OUT_DIR = Path("/tmp/dlo-sp")
br.HANG_S = 100  # a group stuck longer than this dumps its stacks and exits (each takes well under a minute)


def rank_config(rank: int, world: int, port: int, args: argparse.Namespace, name: str, out: str) -> None:
    import torch

    from dlo.engine import OffloadSettings, ParallelSettings, load
    from dlo.engine.parallel import enable_sequence_parallel, make_groups

    base, cap, exchange, gather = split_config(name)
    _, mode, sp = CONFIGS[base]
    dev = br.init(rank, world, port, args.device)
    if args.device == "cpu":
        torch.set_num_threads(1)
    parallel = ParallelSettings(dp=world // sp, sp=sp, sp_kind=args.sp_kind, gather_max_ctas=int(cap) if cap else None)
    groups = make_groups(parallel, dev, gathers=mode == "allgather")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    br.barrier()
    t0 = time.perf_counter()
    m = load(args.ckpt, settings=OffloadSettings(mode, transfer=gather), device=dev, group=groups.shard_group)
    cp = enable_sequence_parallel(m.module, groups, dev, exchange=exchange)
    br.sync(dev)
    br.barrier()
    if rank == 0:
        print(f"  [{name}] loaded in {time.perf_counter() - t0:.1f} s (context parallel: {cp})", flush=True)
    res: dict = {"rank": rank, "load_seconds": time.perf_counter() - t0, "report": m.report.to_dict(),
                 "context_parallel": cp, "workloads": {}}
    for w in args.workloads.split(","):
        # sp: every rank of the group runs the same request (seed 1); dp2: each rank its own (seed 1 + rank)
        inputs = wb.make_inputs(w, str(dev), tiny=args.tiny, seed=1 if sp > 1 else 1 + rank)

        def call(inputs=inputs):
            with torch.no_grad():
                return m.module(**inputs)[0]

        iters = 3 if args.tiny else ITERS[w]
        waited: list[float] = []  # the compute stream's cumulative wait for weights after the warm-up

        def mark() -> None:
            br.sync(dev)
            waited.append(m.stats().gather_wait_seconds)

        times, out_t, first = br.timed(call, dev, iters, after_warmup=mark)  # one warm-up call, then `iters` timed
        mark()
        if rank == 0:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            torch.save(out_t.detach().float().cpu(), OUT_DIR / f"out-{name}-{w}.pt")
            print(f"  [{name}] {w}: {statistics.median(times) * 1e3:.1f} ms per call", flush=True)
        res["workloads"][w] = {
            "seconds": statistics.median(times), "all": times, "first_seconds": first, "sha256_seed1": wb.sha256_of(out_t) if rank == 0 else None,
            "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            # how long this rank's compute stream stood waiting for weights, per timed call (0 resident)
            "gather_wait_ms_per_call": (waited[-1] - waited[0]) / iters * 1e3,
        }
        if args.profile:  # one more call, after the timed ones: where this rank's device time goes
            txt = Path(args.raw).parent / f"profile-{name.replace('@', '.')}-{w}-rank{rank}.txt"  # no '@' in names
            res["workloads"][w]["profile"] = _profiled(call, dev, txt)
    br.gather_results(res, world, rank, out)
    m.close()
    br.leave(rank)


# Kernel name fragments -> category (first match wins; lower case). The categories split one call's
# device time into what Ulysses adds (all-to-alls, the permutes around them) and what it divides.
KERNEL_CATEGORIES = (
    ("nccl_gather", ("allgather",)),
    ("nccl_all_to_all", ("sendrecv", "alltoall")),
    ("nccl_other", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("copy", ("memcpy", "copy", "cat", "transpose", "permute")),
    ("elementwise", ("elementwise", "reduce", "norm", "softmax", "vectorized")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, frags in KERNEL_CATEGORIES if any(f in low for f in frags)), "other")


def _profiled(fn, dev, table: Path) -> dict:
    """One call under the torch profiler: device milliseconds per kernel category and the call's wall
    milliseconds; the top kernels' table goes to `table` beside the raw file."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    br.sync(dev)
    br.barrier()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        br.sync(dev)
    wall = time.perf_counter() - t0
    by_cat: dict[str, float] = {}
    averages = prof.key_averages()
    for e in averages:
        us = getattr(e, "self_device_time_total", 0) or 0
        # kernels and copies only: ranges annotated on the device (`dlo::block`, `nccl:all_to_all`)
        # span kernels already counted (the records of 2026-11-30 count them under `other` and `nccl_other`)
        annotation = getattr(e, "is_user_annotation", False) or e.key.startswith("nccl:")
        if us and e.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            cat = kernel_category(e.key)
            by_cat[cat] = by_cat.get(cat, 0.0) + us / 1e3
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(averages.table(sort_by="self_device_time_total" if dev.type == "cuda"
                                               else "self_cpu_time_total", row_limit=40, max_name_column_width=90))
    return {"wall_ms": wall * 1e3, "device_ms": {k: round(v, 3) for k, v in sorted(by_cat.items())}}


def compare(name: str, w: str) -> dict:
    """Rank 0's seed-1 output of `name` against the one-GPU resident output (`wan_bench.compare_outputs`)."""
    import torch

    return wb.compare_outputs(torch.load(OUT_DIR / f"out-one_gpu_resident-{w}.pt"),
                              torch.load(OUT_DIR / f"out-{name}-{w}.pt"))


def run_plans(args: argparse.Namespace, facts) -> dict:
    """`dlo plan --json` per workload and layout for the full 40-block model, on this node with the
    bandwidths `dlo calibrate` measures (`node/<workload>/<layout>`) and on the same node with a 24 GiB
    device (`24GiB/...`: resident cannot fit, so the plan picks an offload mode)."""
    try:
        calibration, profiles = mb.plan_profiles(args.device, Path("/tmp/dlo-sp-plans"))
    except RuntimeError as e:
        return {"error": str(e)}
    full_bytes = facts.nonblock_bytes + facts.largest_block_bytes * 40
    out: dict = {"calibration": calibration}
    for name, pf in profiles.items():
        for w in args.workloads.split(","):
            tokens = 64 if args.tiny else TOKENS[w]
            for layout, dp, sp in (("dp2", 2, 1), ("sp2", 1, 2)):
                proc = br.dlo("plan", "--model-bytes", str(full_bytes), "--max-block-bytes",
                               str(facts.largest_block_bytes), "--blocks", "40", "--dp", str(dp), "--sp", str(sp),
                               "--tokens", str(tokens // sp), "--profile", str(pf), "--json")
                out[f"{name}/{w}/{layout}"] = (json.loads(proc.stdout) if proc.stdout.strip().startswith("{")
                                               else {"error": (proc.stderr or proc.stdout)[-400:]})
    return out


def run_serve(args: argparse.Namespace) -> dict:
    """`dlo serve --sp 2` against `--sp 1` (dp 1 each: the second on one device) through the openai SDK."""
    import base64
    import hashlib

    from dlo.serving.launch import ServerProcess

    model = Path(f"/tmp/sp-serve-wan-{args.serve_layers}-{args.serve_dim}")
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(model), "--family", "wan",
                        "--layers", str(args.serve_layers), "--dim", str(args.serve_dim), "--dtype",
                        "float32" if args.device == "cpu" else "bfloat16"], check=True)
    out: dict = {"model": str(model), "size": args.serve_size, "configs": {}}
    for sp in (2, 1):
        name = f"sp{sp}"
        t0 = time.perf_counter()
        extra = ["--dp", "1", "--sp", str(sp), "--mode", "allgather", "--device", args.device, "--small-limits",
                 "--max-size", "512", "--warmup-size", args.serve_size]
        try:
            with ServerProcess(model, *extra, log_path=Path(args.raw).parent / f"serve-sp-{name}.log") as srv:
                ready = time.perf_counter() - t0
                client = mb_client(srv.url)
                shas, secs = [], []
                for seed in (7, 8):
                    t1 = time.perf_counter()
                    img = client.images.generate(prompt="a lighthouse at dusk", size=args.serve_size,
                                                 response_format="b64_json",
                                                 extra_body={"seed": seed, "num_inference_steps": args.serve_steps})
                    secs.append(time.perf_counter() - t1)
                    shas.append(hashlib.sha256(base64.b64decode(img.data[0].b64_json)).hexdigest())
                info = srv.ready_info()
            out["configs"][name] = {"sha256": shas, "seconds": secs, "ready_seconds": ready,
                                    "sp": info.get("sp"), "ranks": len(info.get("ranks", [])),
                                    "exit_code": srv.proc.returncode if srv.proc else None}
        except Exception as e:  # a failed configuration is a result too
            out["configs"][name] = {"error": f"{type(e).__name__}: {e}"[-600:]}
        print(f"[serve {name}] {out['configs'][name]}", flush=True)
    c = out["configs"]
    out["bytes_identical_sp2_sp1"] = (c["sp2"].get("sha256") == c["sp1"].get("sha256")
                                      if "sha256" in c["sp2"] and "sha256" in c["sp1"] else None)
    return out


def mb_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)


def run(args: argparse.Namespace) -> int:
    import torch

    n_dev = torch.cuda.device_count() if args.device == "cuda" else 2
    if n_dev < 2:
        raise SystemExit(f"needs 2 devices, found {n_dev}")
    t0 = time.perf_counter()
    ckpt, written, facts = wb.checkpoint_for(args.ckpt, args.layers, args.device, args.tiny)
    args.ckpt = str(ckpt)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    result: dict = records.raw("sp", args.device, {
        "layers": args.layers, "tiny": args.tiny, "devices": n_dev, "sp_kind": args.sp_kind,
        "dlo_ulysses_version": DLO_ULYSSES_VERSION, "model_bytes": facts.bytes,
        "block_bytes": facts.largest_block_bytes, "nonblock_bytes": facts.nonblock_bytes, "checkpoint": written,
        "runs": {}, "seconds": {}, "skipped": {}})
    print(f"checkpoint {ckpt}: {facts.bytes / 1e9:.1f} GB, block {facts.largest_block_bytes / 1e9:.3f} GB "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for name in [c for c in args.configs.split(",") if c]:  # --configs '': the serve check alone
        world, mode, sp = CONFIGS[split_config(name)[0]]
        if sp > 1 and args.sp_kind == "ring" and args.device != "cuda":
            result["skipped"][name] = "ring attention needs cuda (an attention backend returning the log-sum-exp)"
            print(f"[{name}] skipped: {result['skipped'][name]}", flush=True)
            continue
        t1 = time.perf_counter()
        f = OUT_DIR / f"run-{name}.json"
        f.unlink(missing_ok=True)
        try:
            br.spawn(rank_config, world, args, name, str(f))
            result["runs"][name] = json.loads(f.read_text())
        except Exception as e:  # a configuration that fails is a result too
            result["runs"][name] = {"error": str(e)[-500:]}
        result["seconds"][name] = time.perf_counter() - t1
        _save(args, result)  # after every step: a call cut short still leaves what it measured
        r = result["runs"][name]
        print(f"[{name}] " + (" ".join(f"{w} {v['seconds'] * 1e3:.1f} ms" for w, v in r[0]["workloads"].items())
                              if isinstance(r, list) else f"failed: {r['error'][-300:]}")
              + f" ({result['seconds'][name]:.0f} s)", flush=True)
    ref_ok = isinstance(result["runs"].get("one_gpu_resident"), list)
    result["vs_one_gpu"] = {
        name: {w: compare(name, w) for w in r[0]["workloads"]}
        for name, r in result["runs"].items() if ref_ok and isinstance(r, list) and name != "one_gpu_resident"}
    t1 = time.perf_counter()
    result["plans"] = run_plans(args, facts)
    result["seconds"]["plans"] = time.perf_counter() - t1
    result["summary"] = summarize(result)
    _save(args, result)
    if args.serve:
        t1 = time.perf_counter()
        try:
            result["serve"] = run_serve(args)
        except Exception as e:
            result["serve"] = {"error": f"{type(e).__name__}: {e}"[-600:]}
        result["seconds"]["serve"] = time.perf_counter() - t1
    result["summary"] = summarize(result)
    _save(args, result)
    print(json.dumps(result["summary"], indent=1, default=str))
    print(f"wrote {args.raw} ({time.perf_counter() - t0:.0f} s in all)")
    return 0


def _save(args: argparse.Namespace, result: dict) -> None:
    records.write(result, Path(args.raw))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench sp", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one device call: checkpoint once, one process group per configuration")
    r.add_argument("--layers", type=int, default=16)
    r.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}, each optionally @lean or @overlap (DLO_ULYSSES=lean|overlap), "
                        "@peer (DLO_GATHER=peer) and @ctasN")
    r.add_argument("--workloads", default="video,image")
    r.add_argument("--sp-kind", default="ulysses", choices=("ulysses", "ring"))
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--tiny", action="store_true", help="tiny dimensions (CPU dry run)")
    r.add_argument("--ckpt", default=None)
    r.add_argument("--serve", action="store_true", help="also dlo serve --sp 2 vs --sp 1 through the openai SDK")
    r.add_argument("--serve-layers", type=int, default=4)
    r.add_argument("--serve-dim", type=int, default=256)
    r.add_argument("--serve-size", default="256x256")
    r.add_argument("--serve-steps", type=int, default=4)
    r.add_argument("--profile", action="store_true",
                   help="one more call per configuration under the torch profiler: device ms per kernel "
                        "category in the raw record, each rank's top kernels in profile-*.txt beside it")
    r.add_argument("--raw", required=True, help="raw JSON to write")
    m = sub.add_parser("merge", help="raw files -> <tag>.{json,md}")
    m.add_argument("raw_files", nargs="+")
    m.add_argument("--tag", required=True)
    m.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    raise SystemExit(main())
