"""The record of `bench/seed_models.py`: its summary, its markdown, and the merge of its calls.

Owns: `summarize` (the figures issue 28 names, from the runs: `cosmos3_nano_e2e_over_diffusers`,
`minimax_h3_e2e_over_diffusers`: median over median and first over first, `pixel_identical_to_diffusers` {model: bool},
`cosmos3_super_capped64_peak_device_gb`, videos/h, frames/s and Wh/video per run, per-step seconds
and the extrapolations to the recommended step count and to a full-size Super, each labelled; each
run's video seconds with their spread: every try of a served request, the first apart),
`markdown` (from the JSON) and `merge` (one raw record per model into the dated one).
Must never: put a number into the record that no run measured, unless its key says "extrapolated".
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
from pathlib import Path
from typing import Any

from bench.lib import merge as merging
from bench.lib.stats import any_ratio_text, either_ratio, figure_text, spread

GB = 10**9
DATE = re.compile(r"\d{4}-\d\d-\d\d")
# the raws' throughput and energy figures are the fastest try's (the serve run keeps its best of two)
THROUGHPUT_FROM = "each run's fastest try of the video request (videos/h, frames/s, Wh/video)"


def _video(run: dict) -> dict | None:
    return next((r for r in run.get("requests", []) if r.get("kind") == "video" and "seconds" in r), None)


def _seconds(v: dict) -> dict:
    """A request's seconds: every try's spread (served; the first try first), or its one timed call."""
    return spread(v.get("tries_seconds") or [v["seconds"]])


def _identical(rec: dict) -> bool | None:
    """Every served request's bytes equal plain diffusers' (PNG, MP4 with its sound); None: not measured."""
    ref = rec["runs"].get("diffusers_resident", {}).get("requests", [])
    shas = [r.get("sha256") for r in ref]
    served = [run["requests"] for name, run in rec["runs"].items() if name.startswith("serve") and "requests" in run]
    if not shas or not served or None in shas:
        return None
    return all([r.get("sha256") for r in reqs] == shas for reqs in served)


def _per_step(run: dict, family: str) -> float | None:
    """Seconds per denoising step of the video request (Cosmos3: a cond + uncond pair of forwards;
    MiniMax-H3: one forward)."""
    v = _video(run)
    if v is None:
        return None
    if v.get("step_seconds"):  # diffusers: every step timed (the first includes the set-up)
        return round(statistics.median(v["step_seconds"]), 4)
    return v.get("step_seconds_mean")


def _model_summary(rec: dict) -> dict:
    req, fam = rec["request"], rec["family"]
    out: dict[str, Any] = {"preset": rec["make"].get("preset"), "blocks": rec["make"].get("blocks"),
                           "stand_in_text_encoder": rec["make"].get("stand_in_text_encoder"), "runs": {}}
    base = _video(rec["runs"].get("diffusers_resident", {}))
    forwards = req["steps"] - 1 if fam == "minimax-h3" else req["steps"]  # steps that run a forward (or a pair)
    rec_forwards = req["recommended_steps"] - 1 if fam == "minimax-h3" else req["recommended_steps"]
    for name, run in rec["runs"].items():
        v = _video(run)
        if v is None:
            out["runs"][name] = {"error": run.get("error") or next((r.get("error") for r in run.get("requests", [])
                                                                    if r.get("error")), "no video request")}
            continue
        step = _per_step(run, fam)
        row = {k: v.get(k) for k in ("videos_per_hour", "generated_frames_per_second", "wh_per_video",
                                     "energy_joules_per_gpu")}
        secs = _seconds(v)
        row.update(seconds=secs, per_step_seconds=step,
                   over_diffusers=either_ratio(secs, _seconds(base)) if base else None,
                   peak_device_gb=round(run["peak_device_bytes"] / GB, 2) if run.get("peak_device_bytes") else
                   (round(v["peak_device_bytes"] / GB, 2) if v.get("peak_device_bytes") else None))
        if step is not None:  # the same request at the documented step count, extrapolated
            row["extrapolated_seconds_at_recommended_steps"] = round(secs["median"] + (rec_forwards - forwards) * step, 2)
        out["runs"][name] = row
    return out


def summarize(recs: list[dict]) -> dict:
    models = {rec["model"]: _model_summary(rec) for rec in recs}
    s: dict[str, Any] = {"pixel_identical_to_diffusers": {rec["model"]: _identical(rec) for rec in recs},
                         "throughput_from": THROUGHPUT_FROM, "models": models}
    for model, key in (("cosmos3-nano", "cosmos3_nano_e2e_over_diffusers"),
                       ("minimax-h3", "minimax_h3_e2e_over_diffusers")):
        if model in models:
            s[key] = models[model]["runs"].get("serve_rank_local", {}).get("over_diffusers")
    sup = next((rec for rec in recs if rec["model"] == "cosmos3-super"), None)
    if sup is not None:
        capped = models["cosmos3-super"]["runs"].get("serve_capped_64gib", {})
        s["cosmos3_super_capped64_peak_device_gb"] = capped.get("peak_device_gb")
        s["cosmos3_super_capped64_over_diffusers_same_layers"] = capped.get("over_diffusers")
        layers, full = sup["make"].get("blocks"), 64
        if capped.get("per_step_seconds") and layers:  # every block streamed: step time ~ blocks
            s["cosmos3_super_capped64_per_step_seconds_extrapolated_64_layers"] = round(
                capped["per_step_seconds"] * full / layers, 3)
    s["videos_per_hour"] = {f"{m}/{n}": r.get("videos_per_hour") for m, ms in models.items() for n, r in ms["runs"].items()}
    s["wh_per_video"] = {f"{m}/{n}": r.get("wh_per_video") for m, ms in models.items() for n, r in ms["runs"].items()}
    return s


def merge(files: list[Path]) -> dict:
    by_model: dict[str, dict] = {}
    for f in files:  # several calls of one model: their runs together (a later call's run of a name wins)
        rec = json.loads(Path(f).read_text())
        if rec["model"] in by_model:
            by_model[rec["model"]]["runs"].update(rec["runs"])
        else:
            by_model[rec["model"]] = rec
    dates = sorted({m.group(0) for f in files if (m := DATE.search(Path(f).name))})
    # the calls' date (the last, where they span days), not the merge's
    return {"date": dates[-1] if dates else datetime.date.today().isoformat(), "files": [str(f) for f in files],
            "card": merging.one_card(merging.load(files)),
            "models": by_model, "summary": summarize(list(by_model.values()))}


def markdown(merged: dict) -> str:
    s = merged["summary"]
    lines = [f"# The published system's models on {merged.get('card') or 'one card'} ({merged['date']})", "",
             "Raw calls: " + ", ".join(f"`{Path(f).name}`" for f in merged["files"]), "",
             "| summary | value |", "|---|---|"]
    for k, v in s.items():
        if k not in ("models", "videos_per_hour", "wh_per_video"):
            lines.append(f"| `{k}` | {json.dumps(v)} |")
    for model, ms in s["models"].items():
        rec = merged["models"][model]
        lines += ["", f"## {model} (`{ms['preset']}`, {ms['blocks']} blocks"
                  + ("; stand-in text encoder" if ms.get("stand_in_text_encoder") else "") + ")", "",
                  f"Request: `{json.dumps(rec['request'])}`; command `{rec.get('command', '?')}`", "",
                  "| run | video seconds | over diffusers | per step s | videos/h * | frames/s * | Wh/video * | "
                  "peak device GB | s at recommended steps (extrapolated from the median) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, r in ms["runs"].items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error']} |")
                continue
            over = any_ratio_text(r["over_diffusers"], 4) if r["over_diffusers"] else ""
            lines.append(f"| {name} | {figure_text(r['seconds'], ' s')} | {over} | {r['per_step_seconds']} | "
                         f"{r['videos_per_hour']} | {r['generated_frames_per_second']} | {r['wh_per_video']} | "
                         f"{r['peak_device_gb']} | {r.get('extrapolated_seconds_at_recommended_steps')} |")
    lines += ["", "Video seconds: every try's median with n, min-max and the first; over diffusers: median over "
              "median and first over first. * from " + THROUGHPUT_FROM.split(" (")[0] + "."]
    return "\n".join(lines) + "\n"
