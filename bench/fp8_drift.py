"""FP8 streaming's numeric drift (issue 27): each family's output with FP8 weights against bfloat16.

    # CPU, the tiny presets (a proxy: random weights at small width; about a minute)
    python -m bench fp8-drift --out bench/results --stem fp8-drift-tiny-$(date +%F)
    # the GPU host, real widths with few blocks (one call; the full-size figure is the small-GPU record's)
    bash bench/device.sh python -m bench fp8-drift --device cuda --layers 2 --presets wan2.1-t2v-14b,flux.1-dev,qwen-image \
      --out $OUT --stem fp8-drift-$(date +%F)

Per preset: the pipeline folder (`dlo make-random-model`'s writer), one request through
`ServingPipeline` in rank-local mode streaming the weights as stored (`--stream-dtype bfloat16`:
bfloat16 at full size; the tiny presets store float32), then with `--stream-dtype fp8`
(converted at load), then FP8 resident (a different placement: must be bit-identical to the FP8
streamed one). Recorded: max abs difference and PSNR of the decoded frames (floats in [0, 1], what
the PNG/MP4 encodes) and of one transformer forward's output, against the stored dtype; whether FP8 is
bit-identical across the two placements; the streamed bytes per gather of each.
Random weights make these a proxy: real checkpoints' weight distributions (outliers per row) set
the real error, and the tiny presets' widths (32) are far below a real model's.
Must never: report a figure it did not measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import wan_bench as wb
from bench.lib import records

TINY = ("tiny-wan2.1-t2v", "tiny-wan2.1-i2v", "tiny-flux.1-dev", "tiny-qwen-image", "tiny-wan2.2-t2v-a14b")


def _request(facts: Any, tiny: bool) -> Any:
    from dlo.engine.request import Generation

    w, h = (32, 32) if tiny else (832, 480) if facts.temporal_factor else (1024, 1024)
    if facts.temporal_factor:
        return Generation(kind="video", prompt="a lighthouse", seed=3, width=w, height=h, steps=2,
                          guidance_scale=5.0, frames=5 if tiny else 17, fps=16)
    return Generation(kind="image", prompt="a lighthouse", seed=3, width=w, height=h, steps=2, guidance_scale=3.5)


def _frames(pipe: Any, gen: Any) -> Any:
    """The decoded frames of one request (floats in [0, 1]) and one transformer forward's output."""
    import numpy as np
    import torch

    with torch.inference_mode():
        out = pipe.pipe(**pipe.pipeline_kwargs(gen))
    decoded = pipe.adapter.decode(out, gen)
    frames = decoded.video if decoded.video is not None else np.stack(decoded.images)
    return torch.from_numpy(np.asarray(frames, dtype=np.float32))


def _transformer_output(pipe: Any, device: str) -> Any:
    """One forward of the transformer on fixed inputs (the memory probe's, at a small shape)."""
    import torch
    from dlo.engine.peaks_transformer import transformer_inputs

    from dlo.plan.memory_model import Shape

    module = pipe.model.module
    cfg = dict(module.config)
    shape = Shape(32, 32, 5) if pipe.facts.temporal_factor else Shape(32, 32)
    family = pipe.facts.family
    with torch.inference_mode():
        kw = transformer_inputs(family, cfg, shape, 16, 257 if cfg.get("image_dim") else 0, pipe.model.compute_dtype,
                                torch.device(device))
        return module(**kw, return_dict=False)[0].float().cpu()


def measure(folder: Path, device: str, tiny: bool) -> dict:
    from dlo.engine.settings import EngineSettings, OffloadSettings
    from dlo.serving.pipeline import ServingPipeline

    runs: dict[str, Any] = {}
    for label, mode, dtype in (("bfloat16", "rank-local", "bfloat16"), ("fp8", "rank-local", "fp8"),
                               ("fp8_resident", "resident", "fp8")):
        t0 = time.perf_counter()
        pipe = ServingPipeline(folder, EngineSettings(OffloadSettings(mode, stream_dtype=dtype), device=device,
                                                      stream_encoders=True), max_sequence_length=16 if tiny else 512)
        try:
            gen = _request(pipe.facts, tiny)
            stats = pipe.model.stats()
            runs[label] = {"frames": _frames(pipe, gen), "forward": _transformer_output(pipe, device),
                           "h2d_bytes_per_gather": (pipe.model.stats().h2d_bytes - stats.h2d_bytes)
                           // max(1, pipe.model.stats().gathers - stats.gathers),
                           "seconds": round(time.perf_counter() - t0, 2)}
        finally:
            pipe.close()
    out = {"request": {"width": gen.width, "height": gen.height, "frames": gen.frames, "steps": gen.steps}}
    for what in ("frames", "forward"):
        out[f"{what}_fp8_vs_bfloat16"] = wb.compare_outputs(runs["bfloat16"][what], runs["fp8"][what])
        out[f"{what}_fp8_resident_vs_streamed"] = wb.compare_outputs(runs["fp8"][what], runs["fp8_resident"][what])
    out["h2d_bytes_per_gather"] = {k: v["h2d_bytes_per_gather"] for k, v in runs.items() if k != "fp8_resident"}
    out["seconds"] = {k: v["seconds"] for k, v in runs.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fp8-drift", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(TINY))
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks of full-size presets (disk, time)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", type=Path, default=Path("/tmp/fp8-drift-models"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default=f"fp8-drift-tiny-{datetime.date.today().isoformat()}")
    args = ap.parse_args(argv)
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    args.out.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = records.raw("fp8-drift", args.device, {
        "date": datetime.date.today().isoformat(), "device": args.device, "presets": {},
        "note": "random weights: a proxy for the drift of real checkpoints; the baseline streams the weights as "
                "stored (the tiny presets store float32, so their byte ratio is below the 0.5 of a bfloat16 model)"})
    for name in args.presets.split(","):
        folder = args.models / (name + (f"-L{args.layers}" if args.layers else ""))
        if not (folder / "model_index.json").exists():
            write_pipeline(folder, preset(name, args.layers), device=args.device, seed=1)
        try:
            rec["presets"][name] = measure(folder, args.device, name.startswith("tiny-"))
        except Exception as e:  # a preset that fails is recorded, the others still run
            rec["presets"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"{name}: {json.dumps(rec['presets'][name])[:400]}", file=sys.stderr, flush=True)
        records.write(rec, args.out / f"{args.stem}.json")
    records.write(rec, args.out / f"{args.stem}.json", markdown(rec))
    return 0


def markdown(rec: dict) -> str:
    lines = [f"# FP8 streaming drift ({rec['date']}, {rec['device']})", "", "Generated from the JSON beside it. "
             + rec["note"] + ".", "", "| preset | frames max abs | frames PSNR dB | forward max abs | forward PSNR dB | "
             "FP8 resident = streamed | H2D bytes per gather, fp8 / as stored |", "|---|---|---|---|---|---|---|"]
    for name, r in rec["presets"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | | |")
            continue
        f, t = r["frames_fp8_vs_bfloat16"], r["forward_fp8_vs_bfloat16"]
        same = r["frames_fp8_resident_vs_streamed"]["bit_identical"] and r["forward_fp8_resident_vs_streamed"]["bit_identical"]
        h = r["h2d_bytes_per_gather"]
        lines.append(f"| {name} | {f['max_abs_diff']:.4g} | {_db(f['psnr_db'])} | {t['max_abs_diff']:.4g} | "
                     f"{_db(t['psnr_db'])} | {same} | {h['fp8'] / h['bfloat16']:.3f} |")
    return "\n".join(lines + ["", "Command: `" + rec["provenance"]["command"] + "`", ""])


def _db(x: float | None) -> str:
    return "inf" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
