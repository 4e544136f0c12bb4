"""Step caches on full-size models (the step-cache issue's record): `dlo serve` with TaylorSeer and
with First Block Cache against the same request uncached, resident and under `--max-device-memory
24GiB`, against plain diffusers with the same cache configuration resident and with group
offloading (leaf + stream) under the same cap, in one call per model.

    # one GPU, one call per model (the folder is made first; 64 GiB of disk)
    bash bench/device.sh python -m bench step-cache --model wan21 --models /tmp/models --out $OUT --budget-s 500
    # CPU dry run of every step with the tiny preset (no figure of it is a result)
    python -m bench step-cache --model wan21 --dry-run --models /tmp/tiny --out /tmp/step-cache-dry
    # the record of several calls: bench/results/step-cache-<card>-<date>.{json,md}
    python -m bench step-cache --merge RAW.json... --out bench/results

Per model (Wan2.1: an 832x480x17 video; Qwen-Image: a 1024x1024 image) and cache (none, taylorseer,
first-block), `--requests` requests a run (every latency kept: first, median, min, max, n), the
answer's bytes against diffusers' with the same cache (`same_bytes_as_diffusers`), the server's
block calls skipped and weight bytes not streamed (its `/metrics` counters, per cache), and the
cached answer's difference from the uncached one (max abs levels, PSNR, SSIM: a random-weight proxy
for a real checkpoint's). First Block Cache's threshold is searched first on the resident server
(doubled or halved from `--fbc-start` until about 40-50% of block calls are skipped, at most
`--fbc-tries` requests) unless `--fbc-threshold` gives it. The diffusers configs are written here
from diffusers' own classes (`bench.diffusers_baseline.enable_cache`), never from DLO's presets.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.lib import records

from bench._env import multicast_off
multicast_off()

from bench import exact_device as exact  # noqa: E402  (the serve and diffusers runs, the model folders)

TAYLOR = {"cache_interval": 5, "disable_cache_before_step": 3}  # the preset's defaults
RUNS = ("serve_default", "diffusers_resident", "serve_capped", "diffusers_group_offload_capped")
SKIP_GOAL = (0.40, 0.50)  # First Block Cache's share of block calls skipped


def cases(threshold: float) -> dict[str, tuple[Any, Any]]:
    """name -> (the request's `cache`, diffusers' config for the same cache)."""
    return {"none": (None, None),
            "taylorseer": ({"preset": "taylorseer", **TAYLOR}, {"class": "TaylorSeerCacheConfig", "kwargs": {
                **TAYLOR, "use_lite_mode": True}}),
            "first-block": ({"preset": "first-block", "threshold": threshold},
                            {"class": "FirstBlockCacheConfig", "kwargs": {"threshold": threshold}})}


def model_requests(key: str, dry: bool) -> tuple[str, dict]:
    """(preset, the one request of the model): Wan2.1's video, Qwen-Image's image."""
    preset, reqs = (exact.TINY if dry else exact.MODELS)[key]
    kind = "video" if "video" in reqs else "image"
    return preset, reqs[kind]


def block_calls(model: Path, req: dict) -> int:
    """Block calls of one request uncached: steps x transformer calls a step (2 with CFG) x blocks."""
    cfg = json.loads((model / "transformer" / "config.json").read_text())
    blocks = cfg.get("num_layers", 0) + cfg.get("num_single_layers", 0)
    return req["steps"] * (2 if req.get("guidance", 0) > 1 else 1) * blocks


# ---- First Block Cache's threshold -----------------------------------------------------------
def search_threshold(model: Path, req: dict, args: argparse.Namespace) -> dict:
    """The threshold skipping about 40-50% of block calls on this model, one request a try."""
    from openai import OpenAI

    from dlo.serving.launch import ServerProcess

    total, tries, t = block_calls(model, req), [], args.fbc_start
    log = args.out / f"serve-{model.name}-fbc-search.log"
    srv = ServerProcess(model, "--device", args.device, "--dp", "1", log_path=log)
    with srv.start(ready_timeout_s=900):  # a first start measures the device's peaks (minutes)
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
        for _ in range(args.fbc_tries):
            before = exact.counters(srv.metrics())["block_calls_skipped"]
            exact.answer(client, {**req, "cache": cases(t)["first-block"][0]})
            share = (exact.counters(srv.metrics())["block_calls_skipped"] - before) / total
            tries.append({"threshold": t, "skipped_share": round(share, 3)})
            if SKIP_GOAL[0] <= share <= SKIP_GOAL[1]:
                break
            t = t * 2 if share < SKIP_GOAL[0] else t / 2
    best = min(tries, key=lambda x: abs(x["skipped_share"] - sum(SKIP_GOAL) / 2))
    return {"threshold": best["threshold"], "tries": tries, "block_calls_per_request": total}


# ---- the runs --------------------------------------------------------------------------------
def run_model(key: str, args: argparse.Namespace, save: Any) -> dict:
    preset, req = model_requests(key, args.dry_run)
    model = args.models / preset
    rec: dict[str, Any] = {"preset": preset, "request": req,
                           "make": exact.make(model, preset, None, args.device)}
    rec["page_cache_warm_seconds"] = round(exact.warm_page_cache(model), 2)
    rec["first_block"] = ({"threshold": args.fbc_threshold, "given": True} if args.fbc_threshold
                          else search_threshold(model, req, args))
    requests = {name: {**req, "cache": ours, "diffusers_cache": theirs}
                for name, (ours, theirs) in cases(rec["first_block"]["threshold"]).items()}
    rec["requests"] = requests
    save(rec)
    outputs: dict[str, bytes] = {}

    def after(rec: dict) -> None:
        rec["bytes"] = exact.compare(rec, outputs)
        rec["saved"] = saved(rec, requests)
        rec["drift_from_uncached"] = drift(outputs)
        rec["ratios"] = ratios(rec)

    exact.run_runs(key, rec, lambda name: exact.one_run(name, model, requests, args, outputs), args, after, save)
    return rec


def saved(rec: dict, requests: dict) -> dict:
    """Per serve run and cache: block calls skipped and bytes not streamed by its requests (the
    counters' growth over the kind before it, in the order sent)."""
    out: dict[str, Any] = {}
    for run in ("serve_default", "serve_capped"):
        r, last = rec.get(run, {}), {"block_calls_skipped": 0.0, "bytes_not_streamed": 0.0}
        for name in requests:
            now = r.get(name, {}).get("counters")
            if now is None:
                continue
            n = r[name]["seconds"]["n"]
            out[f"{run}:{name}"] = {k: (now[k] - last[k]) / n for k in now}  # per request
            last = now
    return out


def drift(outputs: dict[str, bytes]) -> dict:
    """Each cached answer against the same run's uncached one: max abs, PSNR, SSIM (a proxy)."""
    out: dict[str, Any] = {}
    for key, data in outputs.items():
        run, name = key.split(":")
        ref = outputs.get(f"{run}:none")
        if name == "none" or ref is None:
            continue
        try:
            out[key] = frames_drift(ref, data)
        except Exception as e:  # noqa: BLE001 - recorded
            out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def frames_drift(a: bytes, b: bytes) -> dict:
    """Max abs (levels), PSNR (dB) and mean SSIM of two PNGs or two MP4s, frame by frame."""
    import numpy as np

    fa, fb = _frames(a), _frames(b)
    if fa.shape != fb.shape:
        return {"error": f"shapes {fa.shape} and {fb.shape}"}
    mse = float(((fa - fb) ** 2).mean())  # PNGs and MP4s alike, from the frames decoded once
    return {"max_abs_levels": float(np.abs(fa - fb).max()),
            "psnr_db": None if mse == 0 else round(10 * math.log10(255.0**2 / mse), 2),
            "ssim": round(float(np.mean([ssim(x, y) for x, y in zip(fa, fb)])), 4),
            "note": "random weights: a proxy for a real checkpoint's difference"}


def _frames(data: bytes) -> Any:
    """A PNG's one frame or an MP4's frames, RGB as float (imageio-ffmpeg reads the MP4, as the
    server's encoder writes it)."""
    import tempfile

    import imageio_ffmpeg
    import numpy as np
    from PIL import Image

    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)[None]
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        reader = imageio_ffmpeg.read_frames(f.name)
        meta = next(reader)
        w, h = meta["size"]
        return np.stack([np.frombuffer(b, dtype=np.uint8).reshape(h, w, 3) for b in reader]).astype(np.float64)


def ssim(x: Any, y: Any, window: int = 7) -> float:
    """The mean SSIM of two frames (their luma, `window` x `window` uniform windows, peak 255)."""
    import numpy as np

    def luma(f: Any) -> Any:
        return f[..., :3] @ np.array([0.299, 0.587, 0.114]) if f.ndim == 3 else f

    def mean(img: Any) -> Any:  # the mean of every window (an integral image)
        c = np.pad(img, ((1, 0), (1, 0))).cumsum(0).cumsum(1)
        w = window
        return (c[w:, w:] - c[:-w, w:] - c[w:, :-w] + c[:-w, :-w]) / (w * w)

    a, b = luma(x), luma(y)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ma, mb = mean(a), mean(b)
    va, vb, cov = mean(a * a) - ma**2, mean(b * b) - mb**2, mean(a * b) - ma * mb
    s = ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2))
    return float(s.mean())


def ratios(rec: dict) -> dict:
    """Per cache: the served median and first over the same run uncached, and over diffusers (the
    same cache resident; uncached resident: the issue's bar for the capped run)."""
    out: dict[str, Any] = {}
    for run in ("serve_default", "serve_capped"):
        r = rec.get(run, {})
        base = r.get("none", {}).get("seconds")
        for name in ("taylorseer", "first-block"):
            s = r.get(name, {}).get("seconds")
            if s is None:
                continue
            row: dict[str, Any] = {}
            if base:
                row["speedup_over_uncached_median"] = round(base["median"] / s["median"], 3)
                row["speedup_over_uncached_first"] = round(base["first"] / s["first"], 3)
            for peer, what in (("diffusers_resident", name), ("diffusers_resident", "none"),
                               ("diffusers_group_offload_capped", name)):
                d = rec.get(peer, {}).get(what, {}).get("seconds")
                if d:
                    row[f"over_{peer}_{what.replace('-', '_')}"] = round(s["median"] / d["median"], 3)
            out[f"{run}:{name}"] = row
    return out


def markdown(rec: dict) -> str:
    lines = [f"# Step caches: {rec.get('device_name')} ({rec['date']})", "", f"Command: `{rec['command']}`", "",
             "| model | run | cache | first s | median s | min-max s | n | same bytes as diffusers | "
             "block calls skipped / request | GB not streamed / request |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, m in rec["models"].items():
        for run in RUNS:
            r = m.get(run, {})
            for name in m.get("requests", {}):
                s = r.get(name, {}).get("seconds")
                if s is None:
                    lines.append(f"| {key} | {run} | {name} | {r.get('error') or r.get('skipped', '')} | | | | | | |")
                    continue
                same = m.get("bytes", {}).get(f"{run}:{name}", {}).get("same_bytes_as_diffusers", "ref")
                sv = m.get("saved", {}).get(f"{run}:{name}", {})
                gb = f"{sv['bytes_not_streamed'] / 1e9:.1f}" if sv else ""
                lines.append(f"| {key} | {run} | {name} | {s['first']} | {s['median']} | {s['min']}-{s['max']} | "
                             f"{s['n']} | {same} | {sv.get('block_calls_skipped', '')} | {gb} |")
        lines += ["", f"First Block Cache ({key}): `{json.dumps(m.get('first_block'))}`",
                  f"Ratios ({key}): `{json.dumps(m.get('ratios', {}))}`",
                  f"Difference from uncached ({key}): `{json.dumps(m.get('drift_from_uncached', {}))}`", ""]
    return "\n".join(lines) + "\n"



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench step-cache", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan21", help="comma-separated, of wan21, qwen")
    exact.add_common(ap, "/tmp/step-cache", RUNS)
    ap.add_argument("--fbc-threshold", type=float, default=None, help="First Block Cache's threshold (unset: searched)")
    ap.add_argument("--fbc-start", type=float, default=0.2, help="the search's first threshold")
    ap.add_argument("--fbc-tries", type=int, default=4, help="the search's requests at most")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        print(exact.merge(args.merge, args.out, "step-cache", markdown))
        return 0
    args.device = "cpu" if args.dry_run else "cuda"
    import diffusers
    import torch

    date = datetime.date.today().isoformat()
    rec: dict[str, Any] = records.raw("step-cache", args.device, {
        "date": date, "command": " ".join(["python3", *sys.argv]), "models": {},
        "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__}})
    raw = args.out / f"raw-step-cache-{args.model.replace(',', '-')}-{date}.json"
    for key in args.model.split(","):
        run_model(key, args, lambda r, key=key: (rec["models"].__setitem__(key, r), records.write(rec, raw)))
    records.write(rec, raw)
    print(raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
