"""The cold-start host-memory peak of `dlo serve`, measured in a memory cgroup of its own (issue 28).

    # CPU ranks (this machine: cgroup v1), dp 1, 2 and 4; the model written once into --models
    python -m bench cold-start --models /tmp/cold-models --out bench/results
    # the GPU host, dp 1, if it exposes a memory cgroup (else the record says why not)
    bash bench/device.sh python -m bench cold-start --device cuda --dp 1 --layers 36 --models /tmp/models --out /tmp/o

Per dp: the model's files are dropped from the page cache (`posix_fadvise`), a new memory cgroup
is created under ours (limit `--limit-gib`), `dlo serve MODEL --dp N --mode allgather` starts inside
it, and at `/ready` (load and warm-up done) the group's peak (`memory.max_usage_in_bytes`, v2
`memory.peak`) and `memory.stat` are read; the server is stopped and the group removed. Against:
the checkpoint bytes (every safetensors file of the folder), dp x the checkpoint (what private
copies per rank would cost: the published 132 GB term) and the policy's predicted cold-start
peak (`dlo.plan.policy.estimate_modes`, docs/contracts.md section 7, for this host's profile).

The model: Cosmos3-Nano's transformer at its real shape with `--layers` layers (its 2.5 GB token
embedding and unused LM head are host-only page-cache views in the engine), with a small VAE and
sound tokenizer of the same latent widths (the real ones, 4.8 GB float32, load whole in every rank:
a term per rank this benchmark leaves out on a 23 GiB shared host; `--full-components` keeps them).
Must never: write outside --models/--out, or leave a server or a cgroup behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.cgroup_memory import CgroupUnavailable, MemoryGroup, evict_page_cache
from bench.lib import records

GB = 10**9
GIB = 1 << 30


def model_preset(layers: int, full_components: bool) -> Any:
    """cosmos3-nano at `layers` layers; unless `full_components`, a small VAE (48 latent channels,
    patch 2: what the transformer reads) and sound tokenizer (64-dim latents, 48 kHz)."""
    from dlo.engine.presets import preset
    from dlo.engine.presets_omni import COSMOS3_VAE

    p = preset("cosmos3-nano", layers=layers)
    if full_components:
        return p
    vae = {**COSMOS3_VAE, "base_dim": 8, "decoder_base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}
    sound = {"sampling_rate": 48000, "vocoder_input_dim": 64, "dec_dim": 4, "dec_c_mults": [1, 2, 2, 2, 2],
             "dec_strides": [2, 4, 5, 6, 8], "dec_out_channels": 2, "encoder_enabled": False}
    comps = tuple(dataclasses.replace(c, config=vae) if c.name == "vae" else
                  dataclasses.replace(c, config=sound) if c.name == "sound_tokenizer" else c for c in p.components)
    return dataclasses.replace(p, name=f"{p.name}-L{layers}-small-vae", components=comps)


def ensure_model(models: Path, layers: int, full: bool, device: str) -> Path:
    from dlo.engine.random_model import write_pipeline

    p = model_preset(layers, full)
    out = models / p.name
    if not (out / "model_index.json").exists():
        write_pipeline(out, p, device=device, seed=0)
    return out


def checkpoint_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.rglob("*.safetensors"))


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def predicted(model: Path, dp: int, device: str) -> dict:
    """The policy's cold-start peaks (every mode) for this host's profile, as `dlo serve` builds it."""
    from dlo.plan.policy import estimate_modes
    from dlo.engine.blocks import describe
    from dlo.serving.host import local_profile

    est = estimate_modes(local_profile(device), describe(model), dp, require_bandwidth=False)
    return {k: v.cold_start_peak_bytes for k, v in est.items()}


def run_dp(model: Path, dp: int, args: argparse.Namespace, logs: Path) -> dict:
    from dlo.engine.ports import free_port

    evicted = evict_page_cache(model)
    port = free_port()
    cmd = [sys.executable, "-m", "dlo.cli.main", "serve", str(model), "--dp", str(dp), "--mode", args.mode,
           "--device", args.device, "--port", str(port), "--small-limits", "--warmup-size", "32x32",
           "--video-dir", str(logs / f"videos-dp{dp}")]
    out: dict[str, Any] = {"dp": dp, "mode": args.mode, "evicted_bytes": evicted}
    with MemoryGroup(f"dlo-cold-start-dp{dp}", args.limit_gib * GIB) as group, \
            open(logs / f"serve-dp{dp}.log", "wb") as log:
        t0 = time.monotonic()
        proc = group.popen(cmd, stdout=log, stderr=log)
        try:
            info = _wait_ready(proc, f"http://127.0.0.1:{port}", args.ready_timeout)
            out.update(ready_seconds=round(time.monotonic() - t0, 2), peak_bytes=group.peak(),
                       usage_at_ready_bytes=group.usage(), stat_at_ready=_stat_subset(group.stat()),
                       ranks=[_rank_facts(r) for r in info.get("ranks", [])])
        except (RuntimeError, TimeoutError) as e:
            out.update(error=str(e), peak_bytes=group.peak())
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except Exception:
                proc.kill()
                proc.wait()
    return out


def _wait_ready(proc: Any, url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dlo serve exited with {proc.returncode} before /ready")
        try:
            status, body = _get(url + "/ready")
            if status == 200:
                return body
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready within {timeout:.0f} s")


def _stat_subset(stat: dict[str, int]) -> dict[str, int]:
    keys = ("cache", "rss", "mapped_file", "unevictable", "shmem", "file", "anon", "file_mapped")
    return {k: v for k, v in stat.items() if k in keys}


def _rank_facts(rank: dict) -> dict:
    rep = rank.get("report") or {}
    return {k: rep.get(k) for k in ("rank", "weights_source", "host_pinned_bytes", "slot_bytes", "resident_bytes",
                                    "host_only_bytes", "model_bytes")}


def summarize(rec: dict) -> dict:
    """Per dp: measured peak against the checkpoint, dp x checkpoint and the prediction; the terms."""
    ckpt = rec["checkpoint_bytes"]
    rows = {}
    for r in rec["runs"]:
        if "error" in r:
            rows[str(r["dp"])] = {"error": r["error"]}
            continue
        pinned = sum(x.get("host_pinned_bytes") or 0 for x in r["ranks"])
        # CPU ranks: the "device" (two slots, non-block weights) is host memory, one set per rank
        on_host = sum((x.get("slot_bytes") or 0) + (x.get("resident_bytes") or 0) for x in r["ranks"]) \
            if rec["device"] == "cpu" else 0
        cache = r["stat_at_ready"].get("cache", r["stat_at_ready"].get("file", 0))
        rows[str(r["dp"])] = {
            "peak_gb": round(r["peak_bytes"] / GB, 3), "peak_over_checkpoint": round(r["peak_bytes"] / ckpt, 3),
            "private_copies_gb": round(r["dp"] * ckpt / GB, 3),
            "peak_over_private_copies": round(r["peak_bytes"] / (r["dp"] * ckpt), 3),
            "predicted_gb": round(r["predicted"][rec["mode_key"]] / GB, 3),
            "peak_over_predicted": round(r["peak_bytes"] / r["predicted"][rec["mode_key"]], 3),
            "page_cache_at_ready_gb": round(cache / GB, 3), "arena_gb": round(pinned / GB, 3),
            "device_weights_on_host_gb": round(on_host / GB, 3),
            "rest_per_rank_gb": round((r["peak_bytes"] - cache - pinned - on_host) / r["dp"] / GB, 3),
            "ready_seconds": r["ready_seconds"],
        }
    return rows


def markdown(rec: dict) -> str:
    lines = [f"# Cold-start host peak in a memory cgroup ({rec['date']})", "",
             f"`{rec['command']}`", "",
             f"Model `{rec['model']}`: checkpoint {rec['checkpoint_bytes'] / GB:.2f} GB (transformer "
             f"{rec['transformer_bytes'] / GB:.2f} GB); cgroup v{rec.get('cgroup_version', '?')}, mode {rec['mode']}, "
             f"device {rec['device']}.", "",
             "| dp | peak GB | peak / checkpoint | dp x checkpoint GB | peak / (dp x ckpt) | predicted GB | "
             "peak / predicted | page cache GB | arena GB | slots + resident on host GB | rest per rank GB | ready s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if rec.get("error"):  # no group could be made: nothing was measured, and why
        lines.append(f"| - | not measured: {rec['error']} |")
    for dp, s in rec["summary"].items():
        if "error" in s:
            lines.append(f"| {dp} | error: {s['error']} |")
            continue
        lines.append(f"| {dp} | {s['peak_gb']} | {s['peak_over_checkpoint']} | {s['private_copies_gb']} | "
                     f"{s['peak_over_private_copies']} | {s['predicted_gb']} | {s['peak_over_predicted']} | "
                     f"{s['page_cache_at_ready_gb']} | {s['arena_gb']} | {s['device_weights_on_host_gb']} | "
                     f"{s['rest_per_rank_gb']} | "
                     f"{s['ready_seconds']} |")
    return "\n".join(lines + ["", rec.get("notes", ""), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench cold-start", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, required=True, help="where the model folder is written (once)")
    ap.add_argument("--out", type=Path, required=True, help="record folder: cold-start-<device>-<date>.{json,md}")
    ap.add_argument("--dp", default="1,2,4", help="comma-separated dp values")
    ap.add_argument("--mode", default="allgather", choices=["allgather", "rank-local"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=2, help="Cosmos3-Nano transformer layers (36: full size)")
    ap.add_argument("--full-components", action="store_true", help="the real VAE and sound tokenizer")
    ap.add_argument("--limit-gib", type=int, default=14, help="the group's memory limit (protects the host)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "cold-start-logs"
    logs.mkdir(exist_ok=True)
    model = ensure_model(args.models, args.layers, args.full_components, args.device)
    from dlo.engine.blocks import describe
    from dlo.plan.facts import key_of_mode

    date = datetime.date.today().isoformat()
    rec: dict[str, Any] = records.raw("cold-start", args.device, {
        "date": date, "model": model.name, "checkpoint_bytes": checkpoint_bytes(model),
        "transformer_bytes": describe(model).bytes, "mode": args.mode, "mode_key": key_of_mode(args.mode),
        "device": args.device, "runs": []})
    try:
        rec["cgroup_version"] = MemoryGroup("probe", 0).version
        for dp in (int(x) for x in args.dp.split(",")):
            run = run_dp(model, dp, args, logs)
            run["predicted"] = predicted(model, dp, args.device)
            rec["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "ranks"}), flush=True)
    except CgroupUnavailable as e:
        rec["error"] = f"no memory cgroup: {e}"
    rec["summary"] = summarize(rec) if rec["runs"] else {}
    stem = args.out / f"cold-start-{args.device}-{date}"
    records.write(rec, stem.with_suffix(".json"), markdown(rec))
    print(json.dumps(rec["summary"], indent=2))
    return 0 if "error" not in rec else 1


if __name__ == "__main__":
    raise SystemExit(main())
