"""Exact and out of the box on one GPU (the exactness issue's record): `dlo serve` with every default
(no limits file) resident and under `--max-device-memory 24GiB`, against plain diffusers resident and
with group offloading (leaf + stream) under the same cap, in one call per model.

    # one GPU, one call per model (the folder is made first and deleted after; 64 GiB of disk)
    bash bench/device.sh python -m bench exact --model wan21 --models /tmp/models --out $OUT --budget-s 450
    # CPU dry run of every step with the tiny preset (no figure of it is a result)
    python -m bench exact --model wan21 --dry-run --models /tmp/tiny --out /tmp/exact-dry
    # the record of several calls: bench/results/exact-<card>-<date>.{json,md}
    python -m bench exact --merge RAW.json... --out bench/results

Per run and request kind (Wan2.1: an 832x480x17 video and an 832x480 image; Qwen-Image and
Flux.1-dev: a 1024x1024 image), `--requests` requests (default 3): every latency kept (first, median,
min, max, n: never the best alone), the answer's SHA-256 against diffusers' encoded output of the
same seed, and where they differ the drift (max abs levels, PSNR). A server run also keeps: seconds
to `/ready` and its start-up phases, the limits it derived (`/v1/models`), the plan's tiling rule,
each image's `X-DLO-VAE-Tiled` and `Server-Timing` (the rank's seconds per phase: what is left of the
client's total is HTTP), and every `measured peak:` line of its log (measured against predicted).
The diffusers child is `bench/pipeline.py`'s (`diffusers_baseline.baseline_child`): a warm-up at
the request's size, then the same number of timed calls.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib import records

from bench._env import multicast_off
multicast_off()

from bench.model_folders import make, warm_page_cache
from bench.pipeline_requests import answer
from bench.small_gpu import image_drift

CAP = "24GiB"
CAP_BYTES = 24 * 2**30
VIDEO = {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 5.0}
MODELS: dict[str, tuple[str, dict[str, dict]]] = {
    "wan21": ("wan2.1-t2v-14b", {"video": VIDEO, "image": {"kind": "image", "size": "832x480", "steps": 10,
                                                            "guidance": 5.0}}),
    "qwen": ("qwen-image", {"image": {"kind": "image", "size": "1024x1024", "steps": 10, "guidance": 4.0,
                                      "negative_prompt": True}}),
    "flux": ("flux.1-dev", {"image": {"kind": "image", "size": "1024x1024", "steps": 20, "guidance": 3.5}}),
}
TINY = {"wan21": ("tiny-wan2.1-t2v", {"video": {**VIDEO, "size": "32x32", "frames": 5, "steps": 2},
                                      "image": {"kind": "image", "size": "32x32", "steps": 2, "guidance": 5.0}}),
        "qwen": ("tiny-qwen-image", {"image": {"kind": "image", "size": "32x32", "steps": 2, "guidance": 4.0,
                                               "negative_prompt": True}}),
        "flux": ("tiny-flux.1-dev", {"image": {"kind": "image", "size": "32x32", "steps": 2, "guidance": 3.5}})}
# in order of value: a call cut short by its budget keeps the first ones
RUNS = ("serve_default", "diffusers_resident", "serve_capped", "diffusers_group_offload_capped")


def spread(seconds: list[float]) -> dict[str, Any]:
    """First, median, min, max and n of a run's latencies (the first is the first after ready)."""
    return {"first": round(seconds[0], 3), "median": round(statistics.median(seconds), 3),
            "min": round(min(seconds), 3), "max": round(max(seconds), 3), "n": len(seconds),
            "all": [round(s, 3) for s in seconds]}


# ---- dlo serve -----------------------------------------------------------------------------------
def _request(client: Any, req: dict) -> tuple[float, bytes, dict[str, Any]]:
    """One request over HTTP: (seconds, the PNG or MP4 bytes, what the server said of it)."""
    t0 = time.perf_counter()
    data, said = answer(client, req)
    return time.perf_counter() - t0, data, said


def _log_lines(log: Path, *needles: str) -> list[str]:
    if not log.exists():
        return []
    return [line.strip()[:400] for line in log.read_text(errors="replace").splitlines()
            if any(n in line for n in needles)]


def serve_run(model: Path, requests: dict[str, dict], flags: list[str], args: argparse.Namespace,
              name: str, outputs: dict[str, bytes]) -> dict:
    from dlo.serving.launch import ServerProcess

    log = args.out / f"serve-{model.name}-{name}.log"
    srv = ServerProcess(model, "--device", args.device, "--dp", "1", *flags, log_path=log)
    out: dict[str, Any] = {"flags": flags}
    t0 = time.perf_counter()
    try:
        srv.start(ready_timeout_s=900)
    except RuntimeError as e:
        lines = _log_lines(log, "")
        return {**out, "error": f"{e}: {lines[-1] if lines else ''}"[-1500:], "exit_code": srv.stop()}
    try:
        out["ready_seconds"] = round(time.perf_counter() - t0, 2)
        info = srv.ready_info()
        out.update(mode=info.get("mode"), startup_seconds=info.get("startup_seconds"), plan=info.get("plan"))
        out["limits"] = json.loads(srv.get("/v1/models")[1])["data"][0].get("limits")
        from openai import OpenAI

        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
        for kind, req in requests.items():
            secs, shas, heads = [], [], []
            for i in range(args.requests):
                s, data, h = _request(client, req)
                secs.append(s)
                shas.append(hashlib.sha256(data).hexdigest())
                heads.append(h)
                if i == 0:
                    outputs[f"{name}:{kind}"] = data
            out[kind] = {"seconds": spread(secs), "output_sha256": shas[0], "same_bytes_every_request": len(set(shas)) == 1,
                         "headers": heads, "counters": counters(srv.metrics())}  # cumulative, after this kind
        m = srv.metrics()
        out["peak_device_bytes"] = {lab["rank"]: v for lab, v in m.get("dlo_device_memory_peak_bytes", [])}
    finally:
        out["exit_code"] = srv.stop()
        out["log"] = _log_lines(log, "measured peak:", "peak need:", "peaks:", "limits", "tiling", "plain up to", "mode=",
                                "resident blocks", "budget")[-60:]
    return out


def counters(metrics: dict) -> dict[str, float]:
    """What a server's step caches saved so far, summed over its ranks (`/metrics`)."""
    return {name: sum(v for _, v in metrics.get(f"dlo_cache_{name}_total", []))
            for name in ("block_calls_skipped", "bytes_not_streamed")}


# ---- plain diffusers (bench/pipeline.py's child process) -------------------------------------
def diffusers_run(model: Path, requests: dict[str, dict], extra: dict, args: argparse.Namespace,
                  name: str, outputs: dict[str, bytes]) -> dict:
    out: dict[str, Any] = {"spec": extra}
    for kind, req in requests.items():
        path = args.out / f"{model.name}-{name}-{kind}.out"
        body = {**req, **extra, "repeats": args.requests, "output_path": str(path)}
        if args.device != "cuda":
            body.pop("cap_bytes", None)
        r = subprocess.run([sys.executable, "-m", "bench.pipeline", "--_baseline-child", str(model),
                            "--_request", json.dumps(body), "--device", args.device], capture_output=True, text=True)
        if r.returncode != 0:
            tail = r.stderr[-3000:]
            out[kind] = {"error": "out of device memory" if "OutOfMemory" in tail else "failed", "stderr_tail": tail}
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        out[kind] = {"seconds": spread(res["request_seconds"]), "output_sha256": res["output_sha256"],
                     **{k: res.get(k) for k in ("load_seconds", "peak_device_bytes", "component_peak_device_bytes",
                                                 "encode_seconds")}}
        outputs[f"{name}:{kind}"] = path.read_bytes()
    return out


def compare(rec: dict, outputs: dict[str, bytes]) -> dict:
    """Each run's answer against diffusers resident's (the reference), per request kind."""
    out: dict[str, Any] = {}
    for key, data in outputs.items():
        name, kind = key.split(":")
        ref = outputs.get(f"diffusers_resident:{kind}")
        if name == "diffusers_resident" or ref is None:
            continue
        same = data == ref
        row: dict[str, Any] = {"same_bytes_as_diffusers": same}
        if not same and kind == "image":
            row["drift"] = image_drift(ref, data)
        out[key] = row
    return out


def ratios(rec: dict) -> dict:
    """Each serve run's median and first over diffusers' median of the same kind (resident for the
    default, group offloading for the capped), both sides from this call."""
    pairs = {"serve_default": "diffusers_resident", "serve_capped": "diffusers_group_offload_capped"}
    out: dict[str, Any] = {}
    for serve, peer in pairs.items():
        for kind in rec.get("requests", {}):
            s, d = rec.get(serve, {}).get(kind, {}), rec.get(peer, {}).get(kind, {})
            if "seconds" in s and "seconds" in d:
                base = d["seconds"]["median"]
                out[f"{serve}:{kind}"] = {"over": peer, "median": round(s["seconds"]["median"] / base, 3),
                                          "first": round(s["seconds"]["first"] / base, 3)}
            if serve == "serve_capped" and "seconds" in s and "seconds" in rec.get("diffusers_resident", {}).get(kind, {}):
                base = rec["diffusers_resident"][kind]["seconds"]["median"]
                out[f"{serve}:{kind}:over_resident"] = round(s["seconds"]["median"] / base, 3)
    return out


def one_run(name: str, model: Path, requests: dict[str, dict], args: argparse.Namespace,
            outputs: dict[str, bytes]) -> dict:
    """One of `RUNS`: `dlo serve` with every default or under the cap, plain diffusers resident or
    with group offloading under the cap (cuda only)."""
    if name in ("serve_default", "serve_capped"):
        cap = ["--max-device-memory", CAP] if name == "serve_capped" and args.device == "cuda" else []
        return serve_run(model, requests, cap, args, name, outputs)
    if name == "diffusers_resident":
        return diffusers_run(model, requests, {}, args, name, outputs)
    if name == "diffusers_group_offload_capped":
        if args.device != "cuda":
            return {"skipped": "group offloading with a stream needs cuda"}
        return diffusers_run(model, requests, {"placement": "group_offload", "cap_bytes": CAP_BYTES}, args, name,
                             outputs)
    raise ValueError(f"no run {name!r}; runs: {', '.join(RUNS)}")


def run_runs(key: str, rec: dict, run: Any, args: argparse.Namespace, after: Any, save: Any) -> None:
    """`args.runs` in order within `--budget-s` (a run is skipped, and says so, where its side's
    longest run so far would pass it: a serve start's first measuring says nothing of a diffusers
    run), each one's error recorded, `after(rec)` and `save(rec)` after each."""
    longest: dict[str, float] = {}
    for name in args.runs.split(","):
        side = name.split("_")[0]
        if args.budget_s and time.monotonic() - START + longest.get(side, 0.0) > args.budget_s:
            rec[name] = {"skipped": f"the call's budget of {args.budget_s:.0f} s"}
            continue
        t0 = time.monotonic()
        try:
            rec[name] = run(name)
        except Exception as e:  # recorded, never skipped silently
            rec[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        longest[side] = max(longest.get(side, 0.0), time.monotonic() - t0)
        after(rec)
        print(f"{key} {name}: {json.dumps(rec[name])[:400]}", file=sys.stderr, flush=True)
        save(rec)


def run_model(key: str, args: argparse.Namespace, save: Any) -> dict:
    preset, requests = (TINY if args.dry_run else MODELS)[key]
    model = args.models / preset
    rec: dict[str, Any] = {"preset": preset, "requests": requests, "make": make(model, preset, None, args.device)}
    rec["page_cache_warm_seconds"] = round(warm_page_cache(model), 2)
    save(rec)
    outputs: dict[str, bytes] = {}

    def after(rec: dict) -> None:
        rec["bytes"] = compare(rec, outputs)
        rec["ratios"] = ratios(rec)

    run_runs(key, rec, lambda name: one_run(name, model, requests, args, outputs), args, after, save)
    return rec


def markdown(rec: dict) -> str:
    lines = [f"# Exact and out of the box: {rec.get('device_name')} ({rec['date']})", "",
             f"Command: `{rec['command']}`", "", "| model | run | kind | first s | median s | min-max s | n | "
             "same bytes as diffusers | ready s | limits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, m in rec["models"].items():
        for name in RUNS:
            r = m.get(name, {})
            for kind in m.get("requests", {}):
                k = r.get(kind, {})
                s = k.get("seconds")
                same = m.get("bytes", {}).get(f"{name}:{kind}", {}).get("same_bytes_as_diffusers", "ref")
                if s is None:
                    lines.append(f"| {key} | {name} | {kind} | {r.get('error') or k.get('error') or r.get('skipped', '')} |"
                                 " | | | | | |")
                    continue
                lim = r.get("limits") or {}
                lim_s = f"{lim.get('max_width')}x{lim.get('max_height')}x{lim.get('max_frames')} n{lim.get('max_n')}" \
                    if lim else ""
                lines.append(f"| {key} | {name} | {kind} | {s['first']} | {s['median']} | {s['min']}-{s['max']} | "
                             f"{s['n']} | {same} | {r.get('ready_seconds', '')} | {lim_s} |")
        lines += ["", f"Ratios ({key}): `{json.dumps(m.get('ratios', {}))}`", ""]
    return "\n".join(lines) + "\n"


def merge(paths: list[Path], out: Path, suite: str = "exact", render: Any = None) -> Path:
    """Raws of one card (`bench.lib.merge`) into `out/<suite>-<card>-<date>.{json,md}`: the models of
    every raw, a later raw's run replacing an earlier one's (kept beside it as `NAME@FILE`)."""
    from bench.lib.merge import keyed, load, merged

    sources = load(paths)
    first = sources[0].record
    rec = merged(suite, sources, {"date": first["date"], "command": first["command"],
                                  "device_name": first.get("device_name"), "versions": first.get("versions"),
                                  "models": keyed(sources, "models", depth=2)})
    card = str(rec["device_name"]).replace("NVIDIA ", "").split()[0].lower()
    stem = out / f"{suite}-{card}-{rec['date']}"
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=2) + "\n")
    stem.with_suffix(".md").write_text((render or markdown)(rec))
    return stem


def add_common(ap: argparse.ArgumentParser, out: str, runs: tuple[str, ...]) -> None:
    """The arguments of the one-call-per-model suites (this one, `bench.step_cache`)."""
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"), help="where pipeline folders are written")
    ap.add_argument("--out", type=Path, default=Path(out), help="raw record, logs and outputs")
    ap.add_argument("--requests", type=int, default=3, help="timed requests per run and kind")
    ap.add_argument("--runs", default=",".join(runs), help="comma-separated, in the order to run")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds this call may take")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny presets: every step, no result")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="RAW", help="merge raws into --out")


START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench exact", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan21", help=f"comma-separated, of {', '.join(MODELS)}")
    add_common(ap, "/tmp/exact", RUNS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        print(merge(args.merge, args.out))
        return
    args.device = "cpu" if args.dry_run else "cuda"
    import torch

    date = datetime.date.today().isoformat()
    rec: dict[str, Any] = records.raw("exact", args.device, {
        "date": date, "command": " ".join(["python3", *sys.argv]), "models": {},
        "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__}})
    import diffusers

    rec["versions"]["diffusers"] = diffusers.__version__
    raw = args.out / f"raw-exact-{args.model.replace(',', '-')}-{date}.json"

    def write() -> None:
        records.write(rec, raw)

    for key in args.model.split(","):
        run_model(key, args, lambda r, key=key: (rec["models"].__setitem__(key, r), write()))
    write()
    print(raw)


if __name__ == "__main__":
    raise SystemExit(main())
