"""The published system's own models on one H200 (issue 28): Cosmos3-Nano, Cosmos3-Super and MiniMax-H3
through `dlo serve` against plain diffusers resident, with videos/h, frames/s and Wh/video per run.

    # one call per model (one H200, 64 GiB disk: each model's folder is deleted after its call)
    bash bench/device.sh python -m bench seed-models --model cosmos3-nano --models /tmp/models --out $OUT
    bash bench/device.sh python -m bench seed-models --model minimax-h3 --models /tmp/models --out $OUT
    bash bench/device.sh python -m bench seed-models --model cosmos3-super --models /tmp/models --out $OUT
    # then, anywhere: the merged record bench/results/seed-models-<date>.{json,md}
    python -m bench seed-models --merge RAW-DIR/seed-models-*-raw.json --out bench/results
    # CPU dry run of every step with the tiny presets (no figure of it is a result)
    python -m bench seed-models --model cosmos3-nano --dry-run --models /tmp/tiny --out /tmp/dry

Per model (`MODELS`): `make` writes the preset with random weights on the GPU (`--layers auto`: the
most transformer layers the free disk holds beside the rest; Cosmos3-Nano is full size); MiniMax-H3's
Qwen3-VL-32B text encoder (66.7 GB) cannot share 64 GiB of disk with the transformer: a stand-in
Qwen3-VL (hidden 1024, the 51 layers the pipeline needs; the transformer's `text_dim` follows it,
which changes only its input projection `context_embedder`) takes its place, labelled in the record.
Runs (`--runs`, default all that apply): `diffusers_resident` (a child: `bench/seed_baseline.py`,
plain diffusers, everything on the GPU), `serve_rank_local` (`dlo serve --mode rank-local
--resident-blocks auto`: the fastest on one GPU), `serve_streamed` (rank-local, every block
streamed), and for Cosmos3-Super `serve_capped_64gib` (`--max-device-memory 64GiB`, every block
streamed). Each request (`REQUESTS`: a 480p-class video with fewer frames and steps than the
published 720p / 189 frames / 35 steps; Cosmos3 also a 1-frame PNG) is timed end to end with the
energy NVML counts on every GPU over its wall time; the bytes are compared with diffusers' (the PNG,
and the diffusers frames encoded by the server's own MP4 encoder with the sound track).
The record (`seed_models_record.py`) holds every run and a `summary`; per-step seconds let the
published request be extrapolated (labelled as such).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib import records

from bench._env import multicast_off
multicast_off()

from bench import seed_models_record as record
from bench.video_figures import video_figures

GIB = 1 << 30
# The request sizes (and the step counts their documentation recommends, for the extrapolation)
REQUESTS = {
    "cosmos3": {"kind": "video", "size": "832x480", "frames": 33, "steps": 10, "guidance": 6.0,
                "recommended_steps": 35},  # Cosmos3OmniPipeline's default and diffusers' docs
    # MiniMax-H3: 124 frames is its shortest (5.2 s at 24 fps); 25 evaluations on its model card
    # (quoted second-hand), i.e. num_inference_steps 26 in diffusers (N points, N - 1 forwards)
    "minimax-h3": {"kind": "video", "size": "832x480", "frames": 124, "steps": 8, "guidance": 1.0,
                   "recommended_steps": 26},
}
TINY_REQUESTS = {"cosmos3": {**REQUESTS["cosmos3"], "size": "32x32", "frames": 9, "steps": 2},
                 "minimax-h3": {**REQUESTS["minimax-h3"], "size": "32x32", "steps": 3}}
MODELS = {
    "cosmos3-nano": {"preset": "cosmos3-nano", "tiny": "tiny-cosmos3", "layers": None, "family": "cosmos3",
                     "runs": ("diffusers_resident", "serve_rank_local", "serve_streamed")},
    "cosmos3-super": {"preset": "cosmos3-super", "tiny": "tiny-cosmos3", "layers": "auto", "family": "cosmos3",
                      "runs": ("diffusers_resident", "serve_capped_64gib", "serve_rank_local")},
    # serve_streamed as a second call (`--runs serve_streamed`): its VAE decode of 124 frames makes
    # three runs longer than one call
    "minimax-h3": {"preset": "minimax-h3", "tiny": "tiny-minimax-h3", "layers": "auto", "family": "minimax-h3",
                   "runs": ("diffusers_resident", "serve_rank_local")},
}
SERVE_FLAGS = {
    "serve_rank_local": ("--mode", "rank-local", "--resident-blocks", "auto"),
    "serve_streamed": ("--mode", "rank-local", "--resident-blocks", "0"),
    "serve_capped_64gib": ("--mode", "rank-local", "--resident-blocks", "0", "--max-device-memory", "64GiB"),
}
DISK_HEADROOM = 4 * GIB


def stand_in_text_encoder(p: Any) -> Any:
    """MiniMax-H3 with a Qwen3-VL text encoder of hidden 1024 (51 layers) in place of Qwen3-VL-32B."""
    te = p.component("text_encoder")
    text = {**te.config["text_config"], "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8,
            "num_key_value_heads": 8, "num_hidden_layers": 51}
    vision = {**te.config["vision_config"], "out_hidden_size": 1024, "depth": 2, "deepstack_visual_indexes": [0]}
    comps = []
    for c in p.components:
        if c.name == "text_encoder":
            c = dataclasses.replace(c, config={**c.config, "text_config": text, "vision_config": vision})
        elif c.name == "transformer":
            c = dataclasses.replace(c, config={**c.config, "text_dim": 1024})
        comps.append(c)
    return dataclasses.replace(p, name=p.name + "-te-stand-in", components=tuple(comps))


def fitting_layers(name: str, free: int) -> int:
    """The most transformer layers whose folder (with every other component) fits `free` bytes."""
    from dlo.engine.presets import preset
    from dlo.engine.random_model import estimate

    spec = MODELS[name]
    one, two = (_maybe_stand_in(name, preset(spec["preset"], layers=n)) for n in (1, 2))
    a, b = sum(estimate(one).values()), sum(estimate(two).values())
    full = preset(spec["preset"]).component("transformer").config
    most = full.get("num_layers") or full["num_hidden_layers"]
    return max(1, min(most, 1 + int((free - DISK_HEADROOM - a) // (b - a))))


def _maybe_stand_in(name: str, p: Any) -> Any:
    return stand_in_text_encoder(p) if name == "minimax-h3" else p


def make(name: str, args: argparse.Namespace) -> tuple[Path, dict]:
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    spec = MODELS[name]
    if args.dry_run:
        p = preset(spec["tiny"])
    else:
        layers = spec["layers"]
        if layers == "auto":
            args.models.mkdir(parents=True, exist_ok=True)
            layers = fitting_layers(name, shutil.disk_usage(args.models).free)
        p = _maybe_stand_in(name, preset(spec["preset"], layers=layers))
    out = args.models / p.name
    facts: dict[str, Any] = {"preset": p.name, "stand_in_text_encoder": name == "minimax-h3" and not args.dry_run}
    if not any(out.glob("*model_index.json")):
        facts.update(write_pipeline(out, p, device=args.device, seed=0))
    from dlo.engine.blocks import describe

    d = describe(out)
    facts.update(transformer_bytes=d.bytes, blocks=d.blocks, largest_block_bytes=d.largest_block_bytes,
                 nonblock_bytes=d.nonblock_bytes, checkpoint_bytes=sum(f.stat().st_size for f in out.rglob("*.safetensors")))
    return out, facts


def warm(model: Path) -> dict:
    """The page cache warm before the runs, by the product's own warmer (`dlo warm`)."""
    from dlo.pagecache.warm import warm as warm_files

    session = warm_files([model])
    session.close()
    return {k: v for k, v in session.report().items() if k in ("ok", "seconds", "bytes", "ratio")}


def diffusers_run(model: Path, req: dict, args: argparse.Namespace) -> dict:
    from bench.diffusers_baseline import PROMPT, SEED

    w, h = map(int, req["size"].split("x"))
    child_req = {"prompt": PROMPT, "seed": SEED, "width": w, "height": h, "steps": req["steps"],
                 "guidance": req["guidance"], "frames": req["frames"] if req["kind"] == "video" else 1}
    proc = subprocess.run([sys.executable, "-m", "bench.seed_baseline", str(model), json.dumps(child_req),
                           args.device], capture_output=True, text=True, timeout=args.run_timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"kind": req["kind"], "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return {"kind": req["kind"], **json.loads(line[len("RESULT "):])}


def serve_run(model: Path, requests: list[dict], args: argparse.Namespace, name: str, logs: Path) -> dict:
    from openai import OpenAI

    from dlo.engine.energy import EnergyMeter
    from dlo.serving.launch import ServerProcess
    from bench.pipeline_requests import generate

    limits = logs / f"{name}-limits.json"
    biggest = max(requests, key=lambda r: r["frames"])
    limits.write_text(json.dumps({"max_width": 1920, "max_height": 1920, "max_steps": 100,
                                  "max_frames": max(r["frames"] for r in requests), "default_steps": 2,
                                  "default_size": biggest["size"], "default_video_size": biggest["size"]}))
    flags = ("--device", args.device, "--limits", str(limits), "--warmup-size", "smallest", *SERVE_FLAGS[name])
    t0 = time.perf_counter()
    out: dict[str, Any] = {"flags": list(flags)}
    try:
        srv = ServerProcess(model, *flags, log_path=logs / f"{model.name}-{name}.log").start(ready_timeout_s=600)
    except (RuntimeError, TimeoutError) as e:
        return {**out, "error": str(e)}
    with srv:
        out["ready_seconds"] = round(time.perf_counter() - t0, 2)
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=args.run_timeout)
        out["requests"] = []
        for req in requests:
            # the first pays the request size's first-call costs (the diffusers child warms up at it)
            tries = [_timed(srv, client, req, EnergyMeter, generate) for _ in range(args.repeats)]
            best = min(tries, key=lambda t: t["seconds"])
            out["requests"].append({**best, "tries_seconds": [t["seconds"] for t in tries],
                                    "same_bytes_every_try": len({t["sha256"] for t in tries}) == 1})
        out.update(_server_facts(srv))
    return out


def _timed(srv: Any, client: Any, req: dict, meter_cls: Any, generate: Any) -> dict:
    """One request through the SDK: seconds, its steps (the step histogram around it), bytes, joules."""
    steps0 = _step_totals(srv)
    meter = meter_cls.all_gpus()
    t1 = time.perf_counter()
    data = generate(client, req)
    seconds = time.perf_counter() - t1
    joules = meter.per_gpu() if meter is not None else None
    total, count = (a - b for a, b in zip(_step_totals(srv), steps0))
    return {"kind": req["kind"], "seconds": round(seconds, 3), "steps_observed": int(count),
            "step_seconds_mean": round(total / count, 4) if count else None,
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "joules_per_gpu": joules}


def _step_totals(srv: Any) -> tuple[float, float]:
    """The step histogram's (sum, count): a request's steps are the difference around it."""
    m = srv.metrics()
    return (sum(v for _, v in m.get("dlo_step_duration_seconds_sum", [])),
            sum(v for _, v in m.get("dlo_step_duration_seconds_count", [])))


def _server_facts(srv: Any) -> dict:
    m = srv.metrics()
    info = srv.ready_info()
    rank = info["ranks"][0]
    return {"peak_device_bytes": max((v for _, v in m.get("dlo_device_memory_peak_bytes", [])), default=None),
            "energy_joules_total": {lab["rank"]: v for lab, v in m.get("dlo_device_energy_joules_total", [])},
            "mode": info.get("mode"), "report": rank.get("report"), "component_reports": rank.get("component_reports")}


def run_model(name: str, args: argparse.Namespace) -> dict:
    spec = MODELS[name]
    fam = spec["family"]
    req = (TINY_REQUESTS if args.dry_run else REQUESTS)[fam]
    requests = [req] + ([{**req, "kind": "image", "frames": 1}] if fam == "cosmos3" else [])
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, facts = make(name, args)
    rec: dict[str, Any] = {"model": name, "family": fam, "make": {**facts, "seconds": round(time.perf_counter() - t0, 1)},
                           "request": req, "runs": {}}
    rec["make"]["warm"] = warm(model)
    runs = args.runs.split(",") if args.runs else spec["runs"]
    for run in runs:
        t1 = time.perf_counter()
        if run == "diffusers_resident":
            rec["runs"][run] = {"requests": [diffusers_run(model, r, args) for r in requests]}
        else:
            rec["runs"][run] = serve_run(model, requests, args, run, logs)
        rec["runs"][run]["wall_seconds"] = round(time.perf_counter() - t1, 1)
        for r in rec["runs"][run].get("requests", []):
            if "seconds" in r and r["kind"] == "video":
                r.update(video_figures(r["seconds"], req["frames"], 1, r.get("joules_per_gpu")))
        args.save(rec)
    if not args.keep_model and not args.dry_run:
        shutil.rmtree(model, ignore_errors=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench seed-models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"), help="where model folders are written")
    ap.add_argument("--out", type=Path, required=True, help="where the record goes")
    ap.add_argument("--runs", default="", help="comma-separated runs (default: the model's own list)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny twin preset, tiny requests")
    ap.add_argument("--keep-model", action="store_true", help="keep the model folder after the call")
    ap.add_argument("--run-timeout", type=float, default=420.0, help="seconds one run may take")
    ap.add_argument("--repeats", type=int, default=2, help="requests per serve run (the fastest is kept)")
    ap.add_argument("--merge", nargs="+", type=Path, help="raw records to merge into the dated record")
    ap.add_argument("--stem", default=None, help="the merged record's name (default: seed-models-<the calls' date>)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    if args.merge:
        merged = record.merge(args.merge)
        stem = args.out / (args.stem or f"seed-models-{merged['date']}")
        records.write(merged, stem.with_suffix(".json"), record.markdown(merged))
        print(json.dumps(merged["summary"], indent=2))
        return 0
    if args.model is None:
        ap.error("--model is required (or --merge)")
    if args.dry_run:
        args.device = "cpu"
    raw = args.out / f"seed-models-{args.model}-{date}-raw.json"
    args.save = lambda rec: raw.write_text(json.dumps(rec, indent=2) + "\n")  # after every run
    rec = {**records.raw("seed-models", args.device, {}), **run_model(args.model, args)}
    rec["command"] = " ".join(["python", *sys.argv])
    args.save(rec)
    print(json.dumps(record.summarize([rec]), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
