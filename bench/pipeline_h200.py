"""Full-size pipelines on the GPU (issue 15 item 5): `dlo serve` over HTTP against the same pipeline
resident in plain diffusers, a device-memory cap, Wan2.2's two experts, host memory and readiness.

    # one H200, 64 GiB disk: full Wan2.1-T2V-14B (37.7 GiB) and Flux.1-dev (31.6 GiB) one after the
    # other (each folder is deleted after its runs), Wan2.2 (64.4 GiB) at two layer counts
    python bench/pipeline_h200.py --models /tmp/models --out bench/results --wan22-layers 10,20
    # two H200 (128 GiB disk): Wan2.2 full size, and allgather at dp 2 for the host-memory claim
    python bench/pipeline_h200.py --models /tmp/models --out bench/results --only wan22 --dp 2
    # CPU dry run of every step with the tiny presets (no figure of it is a result)
    python bench/pipeline_h200.py --tiny --models /tmp/tiny-models --out /tmp/pipeline-dry

Runs, per model (`--only wan21,flux,wan22`):
- `make`: `dlo make-random-model --preset P --device cuda` (seconds, bytes), skipped if present;
- `diffusers_resident`: a child process loads the folder with plain diffusers (`from_pretrained`,
  bf16, VAE float32, `.to(cuda)`), runs one warm-up at the request's size with 2 steps, then the
  request: seconds, peak device bytes (allocator), SHA256 of the decoded frames;
- `serve_<mode>`: `dlo serve` (resident for the bytes reference, rank-local, and allgather at
  `--dp` > 1; `--max-device-memory 24GiB` for the capped run) with the page cache warm: seconds to
  `/ready`, the ready report's per-component weights source / host / device bytes, the request
  over HTTP with the official SDK (seconds, SHA256 of the returned PNG/MP4), the allocator peak per
  rank from `/metrics`, and host memory of the whole process tree (PSS: the page cache mapped by the
  ranks counts once) against the checkpoint bytes of the folder;
- `serve_ready_no_warmup`: seconds to `/ready` with `--no-warmup` (the readiness claim: the load alone),
  `..._late_registration` the same with `DLO_REGISTER_EARLY=0` (the page cache registered only when
  the host weights are prepared, not while the imports run), `serve_resident_ready_no_warmup` resident,
  `..._importtime` with `PYTHONPROFILEIMPORTTIME=1` (the server's import profile in its log);
- `serve_rank_local_partial_whole_encoder`: the headline run with `--no-stream-text-encoders`
  (UMT5-XXL / T5-XXL whole on the device instead of streamed, the default).

The record `pipeline-h200-<date>.json` holds every run and a `summary` with
`wan21_e2e_over_resident`, `wan21_capped24_over_uncapped`, `flux_e2e_over_resident`,
`wan22_e2e_over_resident` (null where resident cannot run), `host_bytes_over_checkpoint` (the worst
run), `wan21_ready_seconds` and `peak_device_bytes` per run and component; the markdown beside it is
generated from the JSON. Nothing is written into the record that was not measured by this run.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import wan_bench as wb  # noqa: E402
from import_profile import bytecode_facts, cached, optional_packages_installed  # noqa: E402

wb.ensure_dlo_importable()
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

PROMPT = "a lighthouse on a cliff at dusk, waves breaking below"
SEED = 42

# name -> (preset, request); full size first, the tiny dry run second
MODELS = {
    "wan21": ("wan2.1-t2v-14b", {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 5.0}),
    "flux": ("flux.1-dev", {"kind": "image", "size": "1024x1024", "steps": 20, "guidance": 3.5}),
    "wan22": ("wan2.2-t2v-a14b", {"kind": "video", "size": "832x480", "frames": 17, "steps": 10, "guidance": 4.0}),
}
TINY = {
    "wan21": ("tiny-wan2.1-t2v", {"kind": "video", "size": "32x32", "frames": 5, "steps": 2, "guidance": 5.0}),
    "flux": ("tiny-flux.1-dev", {"kind": "image", "size": "32x32", "steps": 2, "guidance": 3.5}),
    "wan22": ("tiny-wan2.2-t2v-a14b", {"kind": "video", "size": "32x32", "frames": 5, "steps": 4, "guidance": 4.0}),
}


def checkpoint_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.rglob("*.safetensors"))


def warm_page_cache(model: Path) -> float:
    t0 = time.perf_counter()
    for p in sorted(model.rglob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(1 << 26):
                pass
    return time.perf_counter() - t0


def make(model: Path, preset: str, layers: int | None, device: str) -> dict:
    if (model / "model_index.json").exists():
        return {"skipped": "present", "bytes": checkpoint_bytes(model)}
    cmd = [sys.executable, "-m", "dlo.cli.main", "make-random-model", str(model), "--preset", preset, "--device", device,
           "--no-progress"] + (["--layers", str(layers)] if layers else [])
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"make-random-model failed: {r.stderr[-2000:]}")
    return {"command": " ".join(cmd[1:]), "seconds": round(time.perf_counter() - t0, 2), **json.loads(r.stdout)}


# ---- plain diffusers, resident (a child process: its device memory is its own) ---------------------
def resident_child(model: str, request: dict, device: str) -> dict:
    import diffusers
    import numpy as np
    import torch

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    index = json.loads((Path(model) / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(
        model, torch_dtype={"default": dtype, "vae": torch.float32},
        **{name: _transformer(Path(model) / name, device) for name in ("transformer", "transformer_2")
           if (index.get(name) or [None])[0] is not None})
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    from dlo.engine.serving.pipeline import decode_in_own_dtype

    decode_in_own_dtype(pipe.vae)  # Flux/QwenImage hand a float32 VAE bfloat16 latents (the same cast dlo serve makes)
    load = time.perf_counter() - t0
    w, h = map(int, request["size"].split("x"))

    def call(steps: int) -> Any:
        kw: dict[str, Any] = dict(prompt=PROMPT, height=h, width=w, num_inference_steps=steps,
                                  guidance_scale=request["guidance"], output_type="np",
                                  generator=torch.Generator("cpu").manual_seed(SEED), max_sequence_length=512)
        if request["kind"] == "video":
            kw["num_frames"] = request["frames"]
        with torch.inference_mode():
            return pipe(**kw)

    # the file a user gets, with the encoder `dlo serve` uses (random weights give noise-like frames:
    # H.264 of noise costs seconds, of a natural video a fraction of that)
    from dlo.engine.serving.encode import encode_mp4, encode_png

    call(2)  # warm-up at the request's size
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timed: list[tuple[float, float]] = []  # (seconds, pipeline seconds) of each repeat
    for _ in range(max(1, request.get("repeats", 1))):  # as many as the server's requests: the fastest of each
        t1 = time.perf_counter()
        out = call(request["steps"])
        if device == "cuda":
            torch.cuda.synchronize()
        pipeline_seconds = time.perf_counter() - t1
        frames = np.asarray(out.frames if request["kind"] == "video" else out.images)
        if request["kind"] == "video":
            encode_mp4(frames[0], 16)
        else:
            encode_png(frames[0])
        timed.append((time.perf_counter() - t1, pipeline_seconds))
    seconds, pipeline_seconds = min(timed)
    return {"seconds": round(seconds, 3), "pipeline_seconds": round(pipeline_seconds, 3),
            "request_seconds": [round(t, 3) for t, _ in timed],
            "encode_seconds": round(seconds - pipeline_seconds, 3), "load_seconds": round(load, 2),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "frames_sha256": hashlib.sha256(frames.tobytes()).hexdigest()}


def _transformer(folder: Path, device: str) -> Any:
    """A diffusers transformer, whole on the device: its safetensors loaded straight to the device and
    assigned to a skeleton whose parameters are on meta (buffers computed for real). Without the
    accelerate package `from_pretrained` refuses classes with `_keep_in_fp32_modules`, and a plain
    `from_config` would first allocate 57 GB of float32 for a 14B model."""
    import diffusers
    from safetensors.torch import load_file

    from dlo.engine.model import parameters_on_meta

    config = json.loads((folder / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with parameters_on_meta():
        model = cls.from_config(config)
    state: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f, device=device))
    model.load_state_dict(state, strict=True, assign=True)  # the stored dtypes: bf16, fp32-kept modules fp32
    return model.to(device).eval()


def diffusers_resident(model: Path, request: dict, device: str) -> dict:
    r = subprocess.run([sys.executable, __file__, "--_resident-child", str(model), "--_request", json.dumps(request),
                        "--device", device], capture_output=True, text=True)
    if r.returncode != 0:
        tail = r.stderr[-3000:]
        return {"error": "out of device memory" if "OutOfMemory" in tail else "failed", "stderr_tail": tail}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- dlo serve over HTTP -------------------------------------------------------------------------
def _tree_memory(pid: int) -> dict[str, int]:
    """Host memory of the server's process tree (PSS: pages shared by ranks count once): in total,
    in mappings of safetensors files (the page cache the ranks read weights from), and anonymous."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = {"pss_bytes": 0, "pss_safetensors_bytes": 0, "pss_anon_bytes": 0}
    for p in procs:
        try:
            text = Path(f"/proc/{p.pid}/smaps").read_text()
        except OSError:
            continue
        path = ""
        for line in text.splitlines():
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":") or "-" in head[0]:  # a mapping's first line: range perms ... [path]
                path = head[5] if len(head) > 5 else ""
                continue
            if head[0] == "Pss:":
                kb = int(head[1]) * 1024
                out["pss_bytes"] += kb
                if path.endswith(".safetensors"):
                    out["pss_safetensors_bytes"] += kb
            elif head[0] == "Pss_Anon:":
                out["pss_anon_bytes"] += int(head[1]) * 1024
    return out


def serve(model: Path, request: dict, args: argparse.Namespace, name: str, *flags: str) -> dict:
    from openai import OpenAI

    from dlo.engine.serving.launch import ServerProcess

    w, h = request["size"].split("x")
    limits = ["--small-limits"] if args.tiny else ["--max-size", str(max(int(w), int(h))), "--max-steps", "50"]
    settings = [f for f in flags if f.startswith(ENV_PREFIXES) and "=" in f]  # e.g. DLO_REGISTER_EARLY=0
    env = dict(f.split("=", 1) for f in settings)
    flags = tuple(f for f in flags if f not in settings)
    extra = [] if "--no-warmup" in flags else ["--warmup-size", request["size"]]
    log = (args.logs or args.out) / f"serve-{name}.log"
    srv = ServerProcess(model, "--device", args.device, *limits, *extra, *flags, log_path=log, env=env)
    t0 = time.perf_counter()
    srv.start(ready_timeout_s=1800)
    ready_s = time.perf_counter() - t0
    out: dict[str, Any] = {"flags": list(flags) + extra, "ready_seconds": round(ready_s, 2)}
    if env:
        out["env"] = env
    try:
        info = srv.ready_info()
        out["warmup_seconds"] = info.get("warmup_seconds")
        out["startup_seconds"] = info.get("startup_seconds")  # before_load, load, warmup, total
        out["component_reports"] = {str(r["rank"]): r.get("component_reports") for r in info["ranks"]}
        if "--no-warmup" in flags:
            return out
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
        body = {"seed": SEED, "num_inference_steps": request["steps"], "guidance_scale": request["guidance"]}
        shas, secs = [], []
        for _ in range(args.requests):  # the first after ready, then warm ones (the same seed: same bytes)
            t1 = time.perf_counter()
            if request["kind"] == "video":
                job = client.videos.create_and_poll(prompt=PROMPT, size=request["size"], poll_interval_ms=50,
                                                    extra_body={**body, "num_frames": request["frames"]})
                if job.status != "completed":
                    raise RuntimeError(f"video failed: {job.error}")
                data = client.videos.download_content(job.id).read()
            else:
                r = client.images.generate(prompt=PROMPT, size=request["size"], response_format="b64_json",
                                           extra_body=body)
                data = base64.b64decode(r.data[0].b64_json or "")
            secs.append(time.perf_counter() - t1)  # video: includes at most one 50 ms poll and the download
            shas.append(hashlib.sha256(data).hexdigest())
        m = srv.metrics()
        out.update({
            "seconds": round(min(secs), 3), "request_seconds": [round(x, 3) for x in secs],
            "first_request_seconds": round(secs[0], 3), "output_sha256": shas[0],
            "same_bytes_every_request": len(set(shas)) == 1,
            "peak_device_bytes": {lab["rank"]: v for lab, v in m.get("dlo_device_memory_peak_bytes", [])},
            "host_memory": _tree_memory(srv.proc.pid), "checkpoint_bytes": checkpoint_bytes(model),
        })
        # weight bytes the node holds for this server: the mapped page cache (once, whatever dp) plus
        # every rank's arena (registered weights have none); the runtime (Python, torch, CUDA) is in
        # host_memory.pss_bytes beside it
        arenas = sum(c.get("host_bytes", 0) for comps in out["component_reports"].values() for name, c in
                     (comps or {}).items() if c.get("weights_source") == "arena")
        out["host_weight_bytes"] = out["host_memory"]["pss_safetensors_bytes"] + arenas
        out["host_bytes_over_checkpoint"] = round(out["host_weight_bytes"] / out["checkpoint_bytes"], 4)
    finally:
        out["exit_code"] = srv.stop()
    return out


# Share of each transformer's blocks kept on the device in the headline offloaded run: enough that
# streaming the rest hides behind the compute of all of them on one H200 (bench/NOTES.md section 9).
# Measured on 2026-11-30: Wan2.1 at 7,800 tokens streams every block within 2% of resident (its
# compute per block and call is at least the ~13 ms copy of a 0.7 GB block), so a quarter is margin;
# Flux.1-dev at 1024x1024 computes ~0.18 s per step against ~0.46 s to stream its 23.8 GB: at 60%
# resident the copy engine is exactly as busy as the compute and the run measured 1.134x (section 11);
# 75% leaves the copies slack (the first guess, 45%, assumed 0.28 s per step).
ENV_PREFIXES = ("DLO_", "PYTHON")  # a run's flags of these prefixes are its server's environment
RESIDENT_SHARE = {"wan21": 0.25, "flux": 0.75, "wan22": 0.25}


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


def run_model(key: str, args: argparse.Namespace, layers: int | None, save: Any) -> dict:
    preset, request = (TINY if args.tiny else MODELS)[key]
    model = args.models / (preset + (f"-L{layers}" if layers else ""))
    rec: dict[str, Any] = {"preset": preset, "layers": layers, "request": request,
                           "make": make(model, preset, layers, args.device)}
    rec["transformer_blocks"] = transformer_blocks(model)
    rec["page_cache_warm_seconds"] = round(warm_page_cache(model), 2)
    save(rec)
    if not args.runs or "diffusers_resident" in args.runs.split(","):
        rec["diffusers_resident"] = diffusers_resident(model, {**request, "repeats": args.requests}, args.device)
        print(f"{key} diffusers_resident: {json.dumps(rec['diffusers_resident'])[:300]}", file=sys.stderr, flush=True)
        save(rec)
    for name, flags in runs_for(key, args, rec["transformer_blocks"]).items():
        try:
            rec[name] = serve(model, request, args, f"{key}-{name}", *flags)
        except Exception as e:  # a run that fails is recorded as failed, never skipped silently
            rec[name] = {"flags": list(flags), "error": f"{type(e).__name__}: {e}"}
        print(f"{key} {name}: {json.dumps(rec[name])[:300]}", file=sys.stderr, flush=True)
        save(rec)
    if args.delete_after:
        shutil.rmtree(model, ignore_errors=True)
    return rec


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _call_facts(rec: dict, key: str, run: dict) -> Any:
    """`rec[key]` as recorded by the call that measured `run` (a merged record keeps one per file)."""
    facts = rec.get(key)
    return facts.get(run["source"]) if isinstance(facts, dict) and run and "source" in run else facts


def _bytecode_cached(rec: dict, run: dict) -> bool | None:
    """Whether torch and diffusers had cached bytecode in the call that measured `run` (None: not recorded)."""
    facts = _call_facts(rec, "bytecode", run)
    states = [cached(facts, p) for p in ("torch", "diffusers")] if run and facts else [None]
    return None if None in states else all(states)


def _same_bytes(runs: dict) -> bool | None:
    """Whether the current serve runs (a merge keeps replaced ones as `<name>@<file>`: other code,
    other bytes) returned the same output; None with fewer than two to compare."""
    shas = [r["output_sha256"] for n, r in runs.items() if n.startswith("serve_") and "@" not in n
            and isinstance(r, dict) and "output_sha256" in r]
    return None if len(shas) < 2 else len(set(shas)) == 1


def summarize(rec: dict) -> dict:
    def run(model: str, name: str) -> dict:
        """The model's run at full size (key without `@L<layers>`) if it has one, else the first shrunk one."""
        for k in sorted(rec["models"], key=lambda k: "@" in k):
            if k.split("@")[0] == model and name in rec["models"][k]:
                return rec["models"][k][name]
        return {}

    peaks = {f"{m}/{name}": {"ranks": r.get("peak_device_bytes"), "components": r.get("component_reports")}
             for m, v in rec["models"].items() for name, r in v.items()
             if isinstance(r, dict) and "peak_device_bytes" in r}
    hosts = [r["host_bytes_over_checkpoint"] for v in rec["models"].values() for r in v.values()
             if isinstance(r, dict) and "host_bytes_over_checkpoint" in r]
    return {
        # the headline offloaded run (part of each transformer kept resident, RESIDENT_SHARE) ...
        "wan21_e2e_over_resident": _ratio(run("wan21", "serve_rank_local_partial").get("seconds"),
                                          run("wan21", "diffusers_resident").get("seconds")),
        "wan21_capped24_over_uncapped": _ratio(run("wan21", "serve_capped_24gib").get("seconds"),
                                               run("wan21", "serve_rank_local_partial").get("seconds")),
        "flux_e2e_over_resident": _ratio(run("flux", "serve_rank_local_partial").get("seconds"),
                                         run("flux", "diffusers_resident").get("seconds")),
        "wan22_e2e_over_resident": _ratio(run("wan22", "serve_rank_local_partial").get("seconds"),
                                          run("wan22", "diffusers_resident").get("seconds")),
        # ... every block streamed on one GPU, and one request over the pooled host links of dp GPUs
        "streamed_only_over_resident": {m: _ratio(
            v.get("serve_rank_local", {}).get("seconds"), v.get("diffusers_resident", {}).get("seconds"))
            for m, v in rec["models"].items()},
        "allgather_single_over_resident": {m: _ratio(r.get("seconds"), v.get("diffusers_resident", {}).get("seconds"))
                                           for m, v in rec["models"].items() for n, r in v.items()
                                           if n.startswith("serve_allgather_dp") and "@" not in n
                                           and isinstance(r, dict)},
        # our server with everything resident (what the policy picks where the pipeline fits): the
        # serving cost alone (HTTP, PNG/MP4) against the same pipeline in plain diffusers
        "serve_resident_over_resident": {m: _ratio(v.get("serve_resident", {}).get("seconds"),
                                                   v.get("diffusers_resident", {}).get("seconds"))
                                         for m, v in rec["models"].items()},
        "host_bytes_over_checkpoint": max(hosts) if hosts else None,
        "wan21_ready_seconds": run("wan21", "serve_ready_no_warmup").get("ready_seconds"),
        # ... measured with torch's and diffusers' bytecode cached (as an image pip built has it)?
        "wan21_ready_bytecode_cached": _bytecode_cached(rec, run("wan21", "serve_ready_no_warmup")),
        # every such run a merge kept (the spread: start-up is CPU-bound Python, it varies by host load)
        "wan21_ready_seconds_all": [
            {"seconds": r.get("ready_seconds"), "bytecode_cached": _bytecode_cached(rec, r),
             "optional_packages": _call_facts(rec, "optional_packages", r), "source": r.get("source")}
            for m, v in rec["models"].items() if m == "wan21" for n, r in v.items()
            if n.split("@")[0] == "serve_ready_no_warmup" and isinstance(r, dict) and "ready_seconds" in r],
        "bytes_identical_to_resident_serve": {m: _same_bytes(v) for m, v in rec["models"].items()},
        "peak_device_bytes": peaks,
    }


def markdown(rec: dict) -> str:
    lines = [f"# Full-size pipelines ({rec['date']}, {rec['device']})", "", "Generated from the JSON beside it.", "",
             "## Summary", "", "```json", json.dumps({k: v for k, v in rec["summary"].items() if k != "peak_device_bytes"},
                                                      indent=2), "```", "", "## Runs", "",
             "| model | run | seconds | ready s | host/ckpt | sha256 |", "|---|---|---|---|---|---|"]
    for m, v in rec["models"].items():
        for name, r in v.items():
            if isinstance(r, dict) and name.startswith(("serve_", "diffusers_")):
                sha = (r.get("output_sha256") or r.get("frames_sha256") or r.get("error") or "")[:16]
                lines.append(f"| {m} | {name} | {r.get('seconds', '')} | {r.get('ready_seconds', '')} | "
                             f"{r.get('host_bytes_over_checkpoint', '')} | {sha} |")
    lines += ["", "Commands: `" + rec["command"] + "`", ""]
    return "\n".join(lines)


def merge(files: list[Path], stem: Path) -> dict:
    """Several calls' records -> one: per model, a later file's run replaces an earlier one of the same
    name, which stays beside it as `<name>@<its file's stem>`; every run names its file (`source`)."""
    rec: dict[str, Any] = {"sources": [str(f) for f in files], "models": {}}
    for f in files:
        part = json.loads(f.read_text())
        rec.setdefault("date", part["date"])
        rec["device"] = part["device"]
        rec.setdefault("commands", []).append(part["command"])
        rec.setdefault("bytecode", {})[f.stem] = part.get("bytecode")
        rec.setdefault("optional_packages", {})[f.stem] = part.get("optional_packages")
        for m, runs in part["models"].items():
            into = rec["models"].setdefault(m, {})
            for name, r in runs.items():
                if isinstance(r, dict) and (name.startswith(("serve_", "diffusers_"))):
                    r = {**r, "source": f.stem}
                    if name in into:
                        into[f"{name}@{into[name]['source']}"] = into[name]
                into[name] = r
    rec["command"] = " ; ".join(rec["commands"])
    rec["summary"] = summarize(rec)
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(rec))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"), help="where pipeline folders are written")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", default="wan21,flux,wan22")
    ap.add_argument("--device", default=None, help="cuda (default), or cpu (the default with --tiny)")
    ap.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs (default: --out)")
    ap.add_argument("--requests", type=int, default=2, help="requests per server: the first, then warm ones; "
                    "`seconds` is the fastest (the diffusers baseline repeats its call as often)")
    ap.add_argument("--resident-blocks-capped", type=int, default=None,
                    help="resident blocks of the capped Wan2.1 run (default: the headline run's)")
    ap.add_argument("--runs", default="", help="comma-separated run names to keep (default: all)")
    ap.add_argument("--stem", default=None, help="record file name without suffix (default: pipeline-h200-<date>)")
    ap.add_argument("--dp", type=int, default=1, help="also allgather and rank-local at this dp (GPUs)")
    ap.add_argument("--wan22-layers", default="",
                    help="comma-separated layer counts for Wan2.2 when the full 64.4 GiB does not fit the disk")
    ap.add_argument("--delete-after", action=argparse.BooleanOptionalAction, default=True,
                    help="delete each pipeline folder after its runs (disk)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with the tiny-* presets (no results)")
    ap.add_argument("--_resident-child", dest="resident_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_request", dest="request", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="RECORD",
                    help="merge records of several calls into --out/--stem (no runs)")
    args = ap.parse_args()
    if args.merge:
        rec = merge(args.merge, args.out / (args.stem or f"pipeline-h200-{datetime.date.today().isoformat()}"))
        print(json.dumps({k: v for k, v in rec["summary"].items() if k != "peak_device_bytes"}, indent=2))
        return
    if args.resident_child:
        print(json.dumps(resident_child(args.resident_child, json.loads(args.request), args.device)))
        return
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    rec: dict[str, Any] = {"date": date, "device": args.device, "tiny": args.tiny,
                           "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "models": {}}
    if args.device == "cuda":
        import torch

        rec["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    # whether torch / diffusers / transformers import from cached bytecode (as from an image pip built)
    # or compile from source in every process: seconds of every start-up (bench/NOTES.md section 12)
    rec["bytecode"] = bytecode_facts()
    rec["optional_packages"] = optional_packages_installed()  # imported when present; not in the image
    stem = args.out / (args.stem or (f"pipeline-h200-{date}" if not args.tiny else f"pipeline-dry-run-{date}"))

    def write() -> None:  # after every run: a call cut short keeps what it measured
        rec["summary"] = summarize(rec)
        stem.with_suffix(".json").write_text(json.dumps(rec, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown(rec))

    for key in args.only.split(","):
        layer_counts = [int(x) for x in args.wan22_layers.split(",") if x] if key == "wan22" and not args.tiny else []
        for layers in layer_counts or [None]:
            name = key + (f"@L{layers}" if layers else "")
            run_model(key, args, layers, lambda r, name=name: (rec["models"].__setitem__(name, r), write()))
    write()
    print(json.dumps(rec["summary"], indent=2))


if __name__ == "__main__":
    main()
