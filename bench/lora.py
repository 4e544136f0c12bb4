"""LoRA adapters on one card (issue 29): what a rank-64 adapter costs per block and end to end on
Wan2.1-T2V-14B and Flux.1-dev at full size, resident and streamed, and its host and device bytes.

    # two device calls, each through the device prelude (bench/device.sh; `.whl` carried, at most 540 s;
    # one full pipeline on the 64 GiB disk at a time, deleted after its runs):
    timeout 470 bash bench/device.sh python -m bench lora run --only wan21 --models /tmp/models --out $OUT \
      --stem raw-lora-$(date +%F)-wan21 --budget-s 440 2>&1 | tee $OUT/lora-wan21.txt | tail -40
    # the second call: the same with `--only flux` and the stem raw-lora-DATE-flux
    # comes back: raw-lora-DATE-{wan21,flux}.json (+ .txt, logs-*.tgz if tarred); then here:
    python -m bench lora merge bench/results/raw-lora-DATE-*.json --out bench/results --stem lora-DATE
    # CPU dry run of every step with the tiny presets (tests/bench/test_lora.py); no figure is a result
    python -m bench lora run --dry-run --models /tmp/lm --out /tmp/lm-out

Per model, in this order, the raw record rewritten after each step (a call cut short keeps what it
measured; a step the `--budget-s` left no time for is recorded as skipped):
1. `dlo make-random-model` (skipped when present) and `dlo make-random-lora MODEL r64 --rank 64`
   (every block linear) and `--targets attention` (the attention projections), seconds and bytes;
2. `per_block` (`bench/lora_blocks.py`, its own process): the transformer resident through
   `dlo.engine.load`, each adapter through the engine's `LoraBank` (device bytes, host bytes after and
   at the peak of its load), then one forward per token count and variant (base, lora, lora at scale
   0.8, attention only, and two bench-only controls) with events around every block;
3. `serve_resident`, `serve_rank_local_partial` (the headline streamed run: a quarter of Wan's blocks,
   three quarters of Flux's resident), `serve_rank_local` (every block streamed), each with
   `--lora-apply branch`, again with `--lora-apply merge` (`*_merge`) and with the default flags
   (`*_auto`: merged above `--lora-merge-above` tokens a call; `*_fused_auto` the same with every merge in
   one pass, `--lora-merge-kernel triton`, and `*_torch_merge_auto` in peft's two torch steps, `--lora-merge-kernel
   torch`, its control, whatever the default): `dlo serve --lora-dir` over HTTP with the official SDK, the same
   request without and with `"lora": "r64"` alternately, `--requests` times each; the fastest of
   each, their ratio, the bytes (the same across modes, per way of applying?), the adapter's device
   bytes per rank from /ready, peak device and host memory; and `serve_resident_merge_cached`
   (`--lora-merge-cache`: the first request with the adapter fills the cache, the fastest of the
   others is the figure). `--runs` keeps some, `--no-per-block` skips step 2: Wan2.1's ten runs
   take two calls (the 2026-12-02 record's `serve_rank_local_merge_host` and
   `serve_rank_local_partial_merge_cached` used `--lora-host-cache`, since reverted: bench/NOTES.md
   section 18).
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
from bench.lora_record import (AUTO_SUFFIX, FUSED_INFIX, MERGE_SUFFIX, PAIRS_INFIX, RANK, TORCH_MERGE_INFIX,
                               UNPAIRED_INFIX, _ratio, merge, summarize)

from bench.host_memory import tree_memory
from bench.pipeline import checkpoint_bytes, make, transformer_blocks, warm_page_cache
from bench.pipeline_requests import generate, server_limits

TINY_RANK = 8  # the dry run's tiny presets have layers of 32
MODELS = {
    "wan21": {"preset": "wan2.1-t2v-14b", "tokens": [4096, 7800, 32760], "resident_share": 0.25,
              "merge_cache": "40GiB",
              "request": {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 5.0}},
    "flux": {"preset": "flux.1-dev", "tokens": [4096], "resident_share": 0.75,
             "merge_cache": "30GiB", "request": {"kind": "image", "size": "1024x1024", "steps": 20, "guidance": 3.5}},
}
TINY = {
    "wan21": {"preset": "tiny-wan2.1-t2v", "tokens": [64], "resident_share": 0.5,
              "merge_cache": "1GiB",
              "request": {"kind": "video", "size": "32x32", "frames": 5, "steps": 2, "guidance": 5.0}},
    "flux": {"preset": "tiny-flux.1-dev", "tokens": [64], "resident_share": 0.5,
             "merge_cache": "1GiB", "request": {"kind": "image", "size": "32x32", "steps": 2, "guidance": 3.5}},
}
# seconds a step needs at full size (the budget skips what would not fit; the dry run ignores them)
NEEDS = {"per_block": {"wan21": 170, "flux": 50}, "serve": {"wan21": 90, "flux": 60}}
class Budget:
    def __init__(self, seconds: float, dry_run: bool):
        self.end, self.dry_run = time.monotonic() + seconds, dry_run

    def allows(self, seconds: float) -> bool:
        return self.dry_run or time.monotonic() + seconds <= self.end


def make_adapters(model: Path, loras: Path, rank: int = RANK) -> dict:
    """`dlo make-random-lora` (the `dlo` dispatcher, in this process) for every block linear (r64)
    and for the attention projections only; `rank`: 64, or a tiny model's (its layers are narrower:
    `dlo make-random-lora` refuses a rank above a layer's dimensions)."""
    import contextlib
    import io

    from dlo.cli.main import main as dlo

    out = {}
    for name, extra in (("r64", []), ("r64-attention", ["--targets", "attention"])):
        if (loras / name).exists():
            out[name] = {"skipped": "present"}
            continue
        argv = ["make-random-lora", str(model), str(loras / name), "--rank", str(rank), "--no-progress", *extra]
        t0, printed = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = dlo(argv)
        if code != 0:
            raise RuntimeError(f"dlo {' '.join(argv)} exited {code}")
        out[name] = {"command": "dlo " + " ".join(argv), "wall_seconds": round(time.perf_counter() - t0, 2),
                     **json.loads(printed.getvalue())}
    return out


def per_block(model: Path, loras: Path, spec: dict, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "bench.lora_blocks", str(model), str(loras), "--device", args.device,
           "--tokens", ",".join(map(str, spec["tokens"]))] + (["--text-tokens", "8"] if args.dry_run else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": "failed", "stderr_tail": r.stderr[-3000:]}
    return {"command": " ".join(cmd[1:]), **json.loads(r.stdout.strip().splitlines()[-1])}


def serve(model: Path, loras: Path, spec: dict, args: argparse.Namespace, name: str, flags: tuple) -> dict:
    """One `dlo serve --lora-dir` run: the request without and with the adapter, alternately."""
    from openai import OpenAI

    from dlo.serving.launch import ServerProcess

    request = spec["request"]
    limits = server_limits(request, args.dry_run)
    logs = args.logs or args.out
    logs.mkdir(parents=True, exist_ok=True)
    limit_flags = ["--small-limits"]
    if not limits.get("small"):
        (logs / f"limits-{name}.json").write_text(json.dumps(limits))
        limit_flags = ["--limits", str(logs / f"limits-{name}.json")]
    served = loras / ".served"  # the rank-64 adapter alone
    served.mkdir(exist_ok=True)
    if not (served / "r64").exists():
        (served / "r64").symlink_to(loras / "r64")
    srv = ServerProcess(model, "--device", args.device, *limit_flags, "--warmup-size", request["size"],
                        "--lora-dir", str(served), *flags, log_path=logs / f"serve-{name}.log")
    out: dict[str, Any] = {"flags": list(flags)}
    t0 = time.perf_counter()
    try:
        srv.start(ready_timeout_s=1800)
    except RuntimeError as e:
        return {**out, "error": str(e)[-1500:], "exit_code": srv.stop()}
    out["ready_seconds"] = round(time.perf_counter() - t0, 2)
    try:
        info = srv.ready_info()
        out["mode"] = info.get("mode")
        out["lora_device_bytes"] = {str(r["rank"]): (r.get("component_reports") or {}).get("lora", {}).get("device_bytes")
                                    for r in info["ranks"]}
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
        secs: dict[str, list[float]] = {"base": [], "lora": []}
        steps: dict[str, list[float]] = {"base": [], "lora": []}  # the denoising steps' seconds of each request
        shas: dict[str, list[str]] = {"base": [], "lora": []}
        for _ in range(args.requests):
            for variant in ("base", "lora"):
                t1, s1 = time.perf_counter(), step_seconds(srv)
                data = generate(client, {**request, "lora": "r64" if variant == "lora" else None})
                secs[variant].append(round(time.perf_counter() - t1, 3))
                steps[variant].append(round(step_seconds(srv) - s1, 3))
                shas[variant].append(hashlib.sha256(data).hexdigest())
        out.update(request_seconds=secs, seconds={v: min(s) for v, s in secs.items()},
                   ratio=round(min(secs["lora"]) / min(secs["base"]), 4), step_seconds=steps,
                   denoise_ratio=_ratio(min(steps["lora"]), min(steps["base"])),
                   output_sha256={v: s[0] for v, s in shas.items()},
                   same_bytes_every_request=all(len(set(s)) == 1 for s in shas.values()))
        m = srv.metrics()
        out["peak_device_bytes"] = {lab["rank"]: v for lab, v in m.get("dlo_device_memory_peak_bytes", [])}
        out["host_memory"] = tree_memory(srv.proc.pid)
    finally:
        out["exit_code"] = srv.stop()
    return out


def request_of(key: str, args: argparse.Namespace) -> tuple[str, dict]:
    """The model's spec with `--frames`/`--steps` applied to its request, and the key its record
    goes under: `KEY-Nf` for a video request at `--frames N` (another workload, never merged with
    the default request's runs)."""
    spec = dict((TINY if args.dry_run else MODELS)[key])
    request = dict(spec["request"])
    if args.steps:
        request["steps"] = args.steps
    if args.frames and request["kind"] == "video":
        request["frames"] = args.frames
        key = f"{key}-{args.frames}f"
    spec["request"] = request
    return key, spec


def step_seconds(srv: Any) -> float:
    """The server's denoising seconds so far (`dlo_step_duration_seconds`' sum, every rank's)."""
    return sum(v for _, v in srv.metrics().get("dlo_step_duration_seconds_sum", []))


def run_model(base: str, key: str, spec: dict, args: argparse.Namespace, budget: Budget, save: Any) -> dict:
    """`base`'s steps (`key` and `spec` from `request_of`)."""
    model = args.models / spec["preset"]
    loras = args.models / f"loras-{spec['preset']}"
    rank = TINY_RANK if args.dry_run else RANK
    rec: dict[str, Any] = {"preset": spec["preset"], "request": spec["request"], "rank": rank,
                           "make": make(model, spec["preset"], None, args.device)}
    rec["adapters"] = make_adapters(model, loras, rank)
    rec["transformer_blocks"] = transformer_blocks(model)
    rec["checkpoint_bytes"] = checkpoint_bytes(model)
    rec["page_cache_warm_seconds"] = round(warm_page_cache(model), 2)
    save(rec)
    if not args.per_block:
        rec["per_block"] = {"skipped": "--no-per-block"}
    elif budget.allows(NEEDS["per_block"][base]):
        rec["per_block"] = per_block(model, loras, spec, args)
    else:
        rec["per_block"] = {"skipped": "budget"}
    print(f"{key} per_block: {json.dumps(rec['per_block'])[:400]}", file=sys.stderr, flush=True)
    save(rec)
    k = str(max(1, math.ceil(spec["resident_share"] * rec["transformer_blocks"])))
    runs = {"serve_resident": ("--mode", "resident", "--dp", "1"),
            "serve_rank_local_partial": ("--mode", "rank-local", "--dp", "1", "--resident-blocks", k),
            # every block streamed: auto would keep them all where they fit (Flux's 2026-12-01 run did)
            "serve_rank_local": ("--mode", "rank-local", "--dp", "1", "--resident-blocks", "0")}
    base_runs = list(runs.items())
    runs = {n: (*f, "--lora-apply", "branch") for n, f in base_runs}
    runs.update({f"{n}{MERGE_SUFFIX}": (*f, "--lora-apply", "merge") for n, f in base_runs})
    runs.update({f"{n}{AUTO_SUFFIX}": f for n, f in base_runs})  # the default flags
    # the default flags with each merge in one pass, and in two torch steps (its control)
    runs.update({f"{n}{FUSED_INFIX}{AUTO_SUFFIX}": (*f, "--lora-merge-kernel", "triton") for n, f in base_runs})
    runs.update({f"{n}{TORCH_MERGE_INFIX}{AUTO_SUFFIX}": (*f, "--lora-merge-kernel", "torch") for n, f in base_runs})
    # the default flags with CFG pairs: one gather (and one merge) a block a step; base and lora both paired
    runs.update({f"{n}{PAIRS_INFIX}{AUTO_SUFFIX}": (*f, "--cfg-pairs") for n, f in base_runs})
    runs.update({f"{n}{UNPAIRED_INFIX}{AUTO_SUFFIX}": (*f, "--no-cfg-pairs") for n, f in base_runs})
    # every resident layer's merge kept after the first request with the adapter ([Note: the merge cache])
    runs["serve_resident_merge_cached"] = (*runs["serve_resident_merge"], "--lora-merge-cache", spec["merge_cache"])
    for name, flags in runs.items():
        if args.runs and name not in args.runs.split(","):
            continue
        if not budget.allows(NEEDS["serve"][base]):
            rec[name] = {"flags": list(flags), "skipped": "budget"}
        else:
            try:
                rec[name] = serve(model, loras, spec, args, f"{key}-{name}", flags)
            except Exception as e:  # recorded as failed, never skipped silently
                rec[name] = {"flags": list(flags), "error": f"{type(e).__name__}: {e}"}
        print(f"{key} {name}: {json.dumps(rec[name])[:400]}", file=sys.stderr, flush=True)
        save(rec)
    if args.delete_after:
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(loras, ignore_errors=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("run", "merge"))
    ap.add_argument("raws", nargs="*", type=Path, help="merge: the raw records")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--stem", default=None)
    ap.add_argument("--only", default="wan21,flux")
    ap.add_argument("--runs", default="", help="serve runs to keep, comma-separated (default: all nineteen: "
                                               "serve_resident, serve_rank_local_partial, serve_rank_local, each "
                                               f"also with {MERGE_SUFFIX}, {AUTO_SUFFIX}, {FUSED_INFIX}{AUTO_SUFFIX}, "
                                               f"{TORCH_MERGE_INFIX}{AUTO_SUFFIX} and {PAIRS_INFIX}{AUTO_SUFFIX}, "
                                               "and serve_resident_merge_cached)")
    ap.add_argument("--per-block", action=argparse.BooleanOptionalAction, default=True,
                    help="run the per-block step (--no-per-block: the serve runs only, for a second call)")
    ap.add_argument("--requests", type=int, default=2, help="requests per variant and server (the fastest counts)")
    ap.add_argument("--budget-s", type=float, default=440.0, help="skip steps that would end past this")
    ap.add_argument("--frames", type=int, default=0,
                    help="a video model's request at N frames (Wan2.1's own default: 81), recorded as KEY-Nf")
    ap.add_argument("--steps", type=int, default=0, help="the request's steps instead of the model's bench default")
    ap.add_argument("--delete-after", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny presets: every step, no result")
    args = ap.parse_args(argv)
    date = datetime.date.today().isoformat()
    if args.command == "merge":
        rec = merge(args.raws, args.out, args.stem or f"lora-{date}")
        print(json.dumps(rec["summary"], indent=2))
        return 0
    args.device = "cpu" if args.dry_run else "cuda"
    for d in (args.out, args.models):
        d.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = records.raw("lora", args.device, {"date": date, "dry_run": args.dry_run, "device": args.device,
                                                          "command": " ".join(["python3", *sys.argv]), "models": {}})
    if args.device == "cuda":
        import torch

        rec["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    stem = args.out / (args.stem or f"raw-lora-{'dry-run-' if args.dry_run else ''}{date}")
    budget = Budget(args.budget_s, args.dry_run)

    def save(key: str, model_rec: dict) -> None:
        rec["models"][key] = model_rec
        rec["summary"] = summarize(rec)
        stem.with_suffix(".json").write_text(json.dumps(rec, indent=2) + "\n")

    for base in args.only.split(","):
        key, spec = request_of(base, args)
        run_model(base, key, spec, args, budget, lambda r, key=key: save(key, r))
    print(json.dumps(rec["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
