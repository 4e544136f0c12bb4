"""Full-size pipelines on the GPU (issues 15 and 27): `dlo serve` over HTTP against the same pipeline
in plain diffusers (resident, and group offloading under a device-memory cap), caps with the default
mode, the largest request the limits accept, Wan2.2's two experts, host memory and readiness.

    # one H200, 64 GiB disk: one full folder at a time (each is deleted after its runs)
    bash bench/device.sh python -m bench pipeline --only wan21 --models /tmp/models --out /tmp/o --logs /tmp/o/logs \
      --runs diffusers_resident,diffusers_group_offload_capped_24gib,serve_rank_local_partial,serve_default_capped_24gib
    # two H200 (128 GiB disk): Wan2.2 full size, and allgather at dp 2 for the host-memory claim
    bash bench/device.sh python -m bench pipeline --models /tmp/models --out $OUT --only wan22 --dp 2
    # CPU dry run of every step with the tiny presets (no figure of it is a result)
    python -m bench pipeline --tiny --models /tmp/tiny-models --out /tmp/pipeline-dry

Models (`--only wan21,wan21i2v,flux,qwen,wan22`), each with one request and the limits the servers
get (largest size and frames = the request's, one image per request; `--limits-json` adds to them):
- `make`: `dlo make-random-model --preset P --device cuda` (seconds, bytes), skipped if present;
- `diffusers_resident`, `diffusers_resident_capped_24gib`, `diffusers_group_offload_capped_24gib`: a
  child process (`bench/diffusers_baseline.py`) loads the folder with plain diffusers (bf16, VAE
  float32), resident, or with group offloading at leaf level + stream on the transformers and text
  encoders, under the allocator cap `dlo serve --max-device-memory` sets; one warm-up at the
  request's size, then the request (`--requests` times, the fastest kept): seconds, peak device
  bytes overall and per component, host memory (`/proc/self/smaps_rollup`), SHA256 of the frames;
- `serve_<run>` (`runs_for`): `dlo serve` with the page cache warm: seconds to `/ready`, the mode it
  resolved, per-component weights source / host / device bytes, the request over HTTP with the
  official SDK (seconds, SHA256 of the PNG/MP4; image-to-video sends a mid-grey first frame, Qwen
  a negative prompt: true CFG), then the largest request the limits accept (`largest_request`:
  served or not), the allocator peak per rank, and host memory of the whole process tree (PSS from
  `/proc/PID/smaps_rollup`: anonymous and file-backed apart; the page cache the ranks map counts
  once) against the checkpoint bytes of the folder. `serve_default_capped_24gib` and `..._12gib`
  give only the cap (default mode and resident blocks); a server that refuses to start says why in
  `error` (its log's last line).

The record (`pipeline_record.py`: `summary`, markdown, `--merge`) holds every run; nothing is
written into it that was not measured by a run.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib import records
from bench.lib.records import RESULTS
from bench.import_profile import bytecode_facts, optional_packages_installed

from bench._env import multicast_off
multicast_off()  # before torch: the servers and children inherit it

from bench.host_memory import tree_memory
from bench.model_folders import checkpoint_bytes, make, quantize, warm_page_cache
from bench.pipeline_record import PER_RUN, markdown, merge, summarize
from bench.pipeline_requests import generate, grey_png, largest_request, server_limits
from bench.small_gpu import (
    QUANTIZED,
    SMALL_GPU_RUNS,
    beyond_limits,
    fp8_drift,
    plan_lines,
    quantized_folder,
    refused,
    serve_flags,
    served_folder,
)

CAP_24 = 24 * 2**30
START = time.monotonic()  # the call's clock (--budget-s)

# name -> (preset, request); full size first, the tiny dry run second
MODELS = {
    "wan21": ("wan2.1-t2v-14b", {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 5.0}),
    "wan21i2v": ("wan2.1-i2v-14b", {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 5.0,
                                    "image_input": True}),
    "flux": ("flux.1-dev", {"kind": "image", "size": "1024x1024", "steps": 20, "guidance": 3.5}),
    "qwen": ("qwen-image", {"kind": "image", "size": "1024x1024", "steps": 10, "guidance": 4.0,
                            "negative_prompt": True}),
    "wan22": ("wan2.2-t2v-a14b", {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 4.0}),
}
TINY = {
    "wan21": ("tiny-wan2.1-t2v", {"kind": "video", "size": "32x32", "frames": 5, "steps": 2, "guidance": 5.0}),
    "wan21i2v": ("tiny-wan2.1-i2v", {"kind": "video", "size": "32x32", "frames": 5, "steps": 2, "guidance": 5.0,
                                     "image_input": True}),
    "flux": ("tiny-flux.1-dev", {"kind": "image", "size": "32x32", "steps": 2, "guidance": 3.5}),
    "qwen": ("tiny-qwen-image", {"kind": "image", "size": "32x32", "steps": 2, "guidance": 4.0, "negative_prompt": True}),
    "wan22": ("tiny-wan2.2-t2v-a14b", {"kind": "video", "size": "32x32", "frames": 5, "steps": 4, "guidance": 4.0}),
}


# ---- plain diffusers (a child process: its device and host memory are its own) ---------------------
DIFFUSERS_RUNS = {
    "diffusers_resident": {},
    "diffusers_resident_capped_24gib": {"cap_bytes": CAP_24},
    "diffusers_group_offload_capped_24gib": {"placement": "group_offload", "cap_bytes": CAP_24},
}


def diffusers_run(model: Path, request: dict, device: str, **extra: Any) -> dict:
    if device != "cuda":
        extra.pop("cap_bytes", None)  # no allocator to cap on cpu (the dry run)
    if extra.get("placement") == "group_offload" and device != "cuda":
        return {"skipped": "group offloading with a stream needs cuda"}
    r = subprocess.run([sys.executable, "-m", "bench.pipeline", "--_baseline-child", str(model), "--_request",
                        json.dumps({**request, **extra}), "--device", device], capture_output=True, text=True)
    if r.returncode != 0:
        tail = r.stderr[-3000:]
        return {"error": "out of device memory" if "OutOfMemory" in tail else "failed", "stderr_tail": tail, **extra}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- dlo serve over HTTP -------------------------------------------------------------------------
def serve(model: Path, request: dict, args: argparse.Namespace, name: str, *flags: str) -> dict:
    from dlo.serving.launch import ServerProcess

    flags, model = served_folder(flags, model)
    limits = server_limits(request, args.tiny, args.limits_json)
    limit_flags = ["--small-limits"]
    if not limits.get("small"):
        (args.logs or args.out).mkdir(parents=True, exist_ok=True)
        path = (args.logs or args.out) / f"limits-{name}.json"
        path.write_text(json.dumps(limits))
        limit_flags = ["--limits", str(path)]
    settings = [f for f in flags if f.startswith(ENV_PREFIXES) and "=" in f]  # e.g. DLO_REGISTER_EARLY=0
    env = dict(f.split("=", 1) for f in settings)
    flags = tuple(f for f in flags if f not in settings)
    # the small-GPU record keeps the server's default warm-up: the table, not the warm-up, must
    # guarantee the largest request (issue 27)
    extra = [] if "--no-warmup" in flags or args.small_gpu else ["--warmup-size", request["size"]]
    log = (args.logs or args.out) / f"serve-{name}.log"
    srv = ServerProcess(model, "--device", args.device, *limit_flags, *extra, *flags, log_path=log, env=env)
    out: dict[str, Any] = {"flags": list(flags) + extra, "limits": limits}
    t0 = time.perf_counter()
    try:
        srv.start(ready_timeout_s=1800)
    except RuntimeError as e:  # refused or failed before ready: the log's last line says why
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return {**out, "error": f"{e}: {lines[-1] if lines else ''}"[-1500:], "exit_code": srv.stop()}
    out["ready_seconds"] = round(time.perf_counter() - t0, 2)
    if env:
        out["env"] = env
    try:
        _serve_requests(srv, model, request, limits, args, out, flags)
    finally:
        out["exit_code"] = srv.stop()
        out["plan_log"] = plan_lines(log)
    return out


def _serve_requests(srv: Any, model: Path, request: dict, limits: dict, args: argparse.Namespace, out: dict,
                    flags: tuple) -> None:
    """The requests of one run (the timed ones, then the largest accepted) and what the server held."""
    from openai import OpenAI

    info = srv.ready_info()
    out.update(mode=info.get("mode"), warmup_seconds=info.get("warmup_seconds"),
               startup_seconds=info.get("startup_seconds"),  # before_load, load, warmup, total
               component_reports={str(r["rank"]): r.get("component_reports") for r in info["ranks"]})
    if "--no-warmup" in flags:
        return
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
    if request.get("image_input"):  # image-to-video: the same mid-grey first frame as the diffusers child
        request = {**request, "image": grey_png(request["size"])}
    shas, secs = [], []
    first = b""
    waited = gather_wait_seconds(srv)
    for _ in range(args.requests):  # the first after ready, then warm ones (the same seed: same bytes)
        t1 = time.perf_counter()
        data = generate(client, request)
        secs.append(time.perf_counter() - t1)  # video: includes at most one 50 ms poll and the download
        shas.append(hashlib.sha256(data).hexdigest())
        first = first or data
    # the compute stream's waits for weights (rank 0) per timed request: what the copies did not hide
    out["gather_wait_seconds_per_request"] = round((gather_wait_seconds(srv) - waited) / args.requests, 5)
    out.update({"seconds": round(min(secs), 3), "request_seconds": [round(x, 3) for x in secs],
                "first_request_seconds": round(secs[0], 3), "output_sha256": shas[0],
                "same_bytes_every_request": len(set(shas)) == 1, "_output": first})
    largest = largest_request(limits, request)
    if largest.get("image"):
        largest["image"] = grey_png(largest["size"])
    t1 = time.perf_counter()
    try:
        generate(client, largest)
        out["largest_request"] = {"ok": True, "seconds": round(time.perf_counter() - t1, 3)}
    except Exception as e:  # a request that fails is recorded, and the server must still answer
        out["largest_request"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    out["largest_request"].update({k: largest.get(k) for k in ("size", "frames", "n") if largest.get(k)})
    past, limit = beyond_limits(request, limits)  # one step past the limits: a 400 naming the limit
    try:
        generate(client, past)
        out["beyond_limits"] = {"status": 200, "names_limit": False, "limit": limit}
    except Exception as e:
        out["beyond_limits"] = {**refused(e, limit), "limit": limit}
    m = srv.metrics()
    out.update({"peak_device_bytes": {lab["rank"]: v for lab, v in m.get("dlo_device_memory_peak_bytes", [])},
                "host_memory": tree_memory(srv.proc.pid), "checkpoint_bytes": checkpoint_bytes(model)})
    # weight bytes the node holds for this server: the mapped page cache (once, whatever dp) plus
    # every rank's arena (registered weights have none); the runtime (Python, torch, CUDA) is in
    # host_memory.pss_bytes beside it
    arenas = sum(c.get("host_bytes", 0) for comps in out["component_reports"].values() for c in
                 (comps or {}).values() if c.get("weights_source") == "arena")
    out["host_weight_bytes"] = out["host_memory"]["pss_safetensors_bytes"] + arenas
    out["host_bytes_over_checkpoint"] = round(out["host_weight_bytes"] / out["checkpoint_bytes"], 4)


# Share of each transformer's blocks kept on the device in the headline offloaded run: enough that
# streaming the rest hides behind the compute of all of them on one H200 (bench/NOTES.md section 9).
# Measured on 2026-11-30: Wan2.1 at 7,800 tokens streams every block within 2% of resident (its
# compute per block and call is at least the ~13 ms copy of a 0.7 GB block), so a quarter is margin;
# Flux.1-dev at 1024x1024 computes ~0.18 s per step against ~0.46 s to stream its 23.8 GB: at 60%
# resident the copy engine is exactly as busy as the compute and the run measured 1.134x (section 11);
# 75% leaves the copies slack (the first guess, 45%, assumed 0.28 s per step). Wan2.1-I2V as Wan2.1;
# Qwen-Image (60 blocks of 0.68 GB, 4,096 image tokens) half, a first guess not yet measured.
ENV_PREFIXES = ("DLO_", "PYTHON")  # a run's flags of these prefixes are its server's environment
RESIDENT_SHARE = {"wan21": 0.25, "wan21i2v": 0.25, "flux": 0.75, "qwen": 0.5, "wan22": 0.25}


def gather_wait_seconds(srv: Any) -> float:
    """Rank 0's `dlo_gather_wait_seconds` so far (0 where it has none: resident runs)."""
    return sum(v for labels, v in srv.metrics().get("dlo_gather_wait_seconds_total", []) if labels.get("rank") == "0")


def transformer_blocks(model: Path) -> int:
    config = json.loads((model / "transformer" / "config.json").read_text())
    return int(config.get("num_layers", 0)) + int(config.get("num_single_layers", 0))


def runs_for(key: str, args: argparse.Namespace, n_blocks: int) -> dict[str, tuple[str, ...]]:
    """The `dlo serve` runs of one model, most important first (a call cut short keeps those)."""
    k = str(max(1, math.ceil(RESIDENT_SHARE[key] * n_blocks)))
    rl = ("--mode", "rank-local", "--dp", "1")
    runs: dict[str, tuple[str, ...]] = {
        "serve_rank_local_partial": (*rl, "--resident-blocks", k),  # the headline offloaded run, one GPU
        "serve_resident": ("--mode", "resident", "--dp", "1"),  # the bytes reference
        "serve_rank_local": rl,  # streaming every block
    }
    if args.device == "cuda":  # a smaller device, as a new user asks for it: the cap, nothing else
        runs["serve_default_capped_24gib"] = ("--dp", "1", "--max-device-memory", "24GiB")
        runs["serve_default_capped_12gib"] = ("--dp", "1", "--max-device-memory", "12GiB")
    if args.dp > 1:  # one request, the other rank gathers only: the host links of dp GPUs pooled
        runs[f"serve_allgather_dp{args.dp}"] = ("--mode", "allgather", "--dp", str(args.dp))
    if args.device == "cuda" and key == "wan21":
        kc = str(args.resident_blocks_capped) if args.resident_blocks_capped is not None else k
        runs["serve_capped_24gib"] = (*rl, "--resident-blocks", kc, "--max-device-memory", "24GiB")
    if args.device == "cuda" and key == "wan22":
        runs["serve_capped_48gib"] = (*rl, "--resident-blocks", k, "--max-device-memory", "48GiB")
    runs["serve_ready_no_warmup"] = (*rl, "--resident-blocks", k, "--no-warmup")
    # the same load registering the page cache only when the host weights are prepared (the order
    # before `EarlyRegistration`), and resident (what a GPU that holds the pipeline serves)
    runs["serve_ready_no_warmup_late_registration"] = (*rl, "--resident-blocks", k, "--no-warmup",
                                                       "DLO_REGISTER_EARLY=0")
    runs["serve_resident_ready_no_warmup"] = ("--mode", "resident", "--dp", "1", "--no-warmup")
    # the large text encoder whole on the device (the default streams it; the twin of the headline run)
    runs["serve_rank_local_partial_whole_encoder"] = (*rl, "--resident-blocks", k, "--no-stream-text-encoders")
    # the ready load with Python's import profile in its log (where the imports' seconds go; slower)
    runs["serve_ready_no_warmup_importtime"] = (*rl, "--resident-blocks", k, "--no-warmup",
                                                "PYTHONPROFILEIMPORTTIME=1")
    if args.runs:
        runs = {n: f for n, f in runs.items() if n in args.runs.split(",")}
    return runs


def call_plan(key: str, args: argparse.Namespace, n_blocks: int) -> list[tuple[str, Any]]:
    """(run name, diffusers extra or serve flags) in the order this call runs them: the small-GPU
    record's order of value, or the chosen diffusers runs then every serve run."""
    if args.small_gpu:
        keep = args.runs.split(",") if args.runs else None
        return [(n, DIFFUSERS_RUNS[n] if n.startswith("diffusers_") else serve_flags(n, args.device))
                for n in SMALL_GPU_RUNS[key] if keep is None or n in keep]
    chosen = args.runs.split(",") if args.runs else ["diffusers_resident"]
    return ([(n, extra) for n, extra in DIFFUSERS_RUNS.items() if n in chosen]
            + list(runs_for(key, args, n_blocks).items()))


def run_model(key: str, args: argparse.Namespace, layers: int | None, save: Any) -> dict:
    preset, request = (TINY if args.tiny else MODELS)[key]
    model = args.models / (preset + (f"-L{layers}" if layers else ""))
    rec: dict[str, Any] = {"preset": preset, "layers": layers, "request": request,
                           "make": make(model, preset, layers, args.device)}
    rec["transformer_blocks"] = transformer_blocks(model)
    if not args.small_gpu or rec["make"].get("skipped"):  # a folder just written is in the page cache
        rec["page_cache_warm_seconds"] = round(warm_page_cache(model), 2)
    save(rec)
    outputs: dict[str, bytes] = {}
    longest = 0.0
    for name, spec in call_plan(key, args, rec["transformer_blocks"]):
        if args.budget_s and time.monotonic() - START + longest > args.budget_s:
            rec[name] = {"skipped": f"the call's budget of {args.budget_s:.0f} s (the longest run so far took "
                                    f"{longest:.0f} s)"}
            save(rec)
            continue
        t0 = time.monotonic()
        try:
            if name.startswith("diffusers_"):
                rec[name] = diffusers_run(model, {**request, "repeats": args.requests}, args.device, **spec)
            else:
                if QUANTIZED in spec and "quantize" not in rec:
                    rec["quantize"] = quantize(model)
                rec[name] = serve(model, request, args, f"{key}-{name}", *spec)
                outputs[name] = rec[name].pop("_output", b"")
        except Exception as e:  # a run that fails is recorded as failed, never skipped silently
            rec[name] = {"spec": list(spec) if isinstance(spec, tuple) else spec, "error": f"{type(e).__name__}: {e}"}
        longest = max(longest, time.monotonic() - t0)
        print(f"{key} {name}: {json.dumps(rec[name])[:300]}", file=sys.stderr, flush=True)
        if args.small_gpu:
            rec["fp8_drift"] = fp8_drift(outputs)
        save(rec)
    if args.delete_after:
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(quantized_folder(model), ignore_errors=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"), help="where pipeline folders are written")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--only", default="wan21,flux,wan22", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--device", default=None, help="cuda (default), or cpu (the default with --tiny)")
    ap.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs (default: --out)")
    ap.add_argument("--requests", type=int, default=2, help="requests per server: the first, then warm ones; "
                    "`seconds` is the fastest (the diffusers baseline repeats its call as often)")
    ap.add_argument("--resident-blocks-capped", type=int, default=None,
                    help="resident blocks of the capped Wan2.1 run (default: the headline run's)")
    ap.add_argument("--runs", default="", help="comma-separated run names to keep (default: diffusers_resident "
                    "and every serve run)")
    ap.add_argument("--limits-json", default=None, help='added to each server\'s limits, e.g. \'{"max_n": 2}\'')
    ap.add_argument("--stem", default=None, help="record file name without suffix (default: pipeline-<date>)")
    ap.add_argument("--dp", type=int, default=1, help="also allgather and rank-local at this dp (GPUs)")
    ap.add_argument("--wan22-layers", default="",
                    help="comma-separated layer counts for Wan2.2 when the full 64.4 GiB does not fit the disk")
    ap.add_argument("--delete-after", action=argparse.BooleanOptionalAction, default=True,
                    help="delete each pipeline folder after its runs (disk)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with the tiny-* presets (no results)")
    ap.add_argument("--small-gpu", action="store_true",
                    help="the small-GPU record (issue 27): each model's runs of bench/small_gpu.py in order of value, "
                         "record small-gpu-<date>")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds this call may take: a run that would end past it (judged by the longest run "
                         "so far) is recorded as skipped")
    ap.add_argument("--_baseline-child", dest="baseline_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_request", dest="request", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="RECORD",
                    help="merge records of several calls into --out/--stem (no runs)")
    args = ap.parse_args(argv)
    if args.merge:
        rec = merge(args.merge, args.out / (args.stem or f"pipeline-{datetime.date.today().isoformat()}"))
        print(json.dumps({k: v for k, v in rec["summary"].items() if k not in PER_RUN}, indent=2))
        return
    if args.baseline_child:
        from bench.diffusers_baseline import baseline_child

        print(json.dumps(baseline_child(args.baseline_child, json.loads(args.request), args.device)))
        return
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    for d in (args.out, args.logs, args.models):
        if d:
            d.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    rec: dict[str, Any] = records.raw("pipeline", args.device, {
        "date": date, "device": args.device, "tiny": args.tiny,
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "models": {}})
    if args.device == "cuda":
        import torch

        rec["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    # whether torch / diffusers / transformers import from cached bytecode (as from an image pip built)
    # or compile from source in every process: seconds of every start-up (record pipeline-h200-2026-11-30)
    rec["bytecode"] = bytecode_facts()
    rec["optional_packages"] = optional_packages_installed()  # imported when present; not in the image
    kind = "small-gpu" if args.small_gpu else "pipeline"
    stem = args.out / (args.stem or (f"{kind}-{date}" if not args.tiny else f"{kind}-dry-run-{date}"))

    def write() -> None:  # after every run: a call cut short keeps what it measured
        rec["summary"] = summarize(rec)
        records.write(rec, stem.with_suffix(".json"), markdown(rec))

    for key in args.only.split(","):
        layer_counts = [int(x) for x in args.wan22_layers.split(",") if x] if key == "wan22" and not args.tiny else []
        for layers in layer_counts or [None]:
            name = key + (f"@L{layers}" if layers else "")
            run_model(key, args, layers, lambda r, name=name: (rec["models"].__setitem__(name, r), write()))
    write()
    print(json.dumps(rec["summary"], indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
