"""Device-memory calibration (issue 27): what a request needs beyond the weights, per family and
shape, measured on the GPU; `merge` fits the table the memory model reads (`plan/memory_table.json`).

    # on the GPU host (one card, ONE call of at most 8 minutes: about 5 min measured + start-up),
    # through the device prelude (bench/device.sh; `.whl` carried), at most 540 s:
    timeout 480 bash bench/device.sh python -m bench memory run --models /tmp/mm --out $OUT --stem raw-memory-$(date +%F) \
      --total-s 420 2>&1 | tee $OUT/memory-bench.txt | tail -30
    # comes back: raw-memory-DATE-{wan,wan-i2v,flux,qwen-image}.json and memory-bench.txt
    # here, no device: the table and the record beside the raws
    python -m bench memory merge bench/results/raw-memory-DATE-*.json --table plan/memory_table.json \
      --out bench/results --stem memory-DATE
    # CPU dry run of every step with the tiny presets (CI: tests/bench/test_memory.py); no figure
    # of it is a result, and merge refuses it
    python -m bench memory run --dry-run --models /tmp/mm --out /tmp/mm-out

Per family (`--families wan,wan-i2v,flux,qwen-image`), in this order and each in its own process
(its own allocator, uncapped, PYTORCH_CUDA_ALLOC_CONF unset as `dlo serve` runs by default):
`dlo make-random-model DIR --preset P --layers 2 --device cuda` (transformer and large text encoder
at 2 blocks at real width: a block's activations do not depend on how many blocks follow; the
VAE, CLIP and image encoders whole), then `bench/memory_probe.py` measures the loads (weights
placed against the memory model's formula), the text encoders at 128 and 512 tokens, the image
encoder, one transformer forward at each shape of the plan, the VAE decode (plain, then tiled) and
image-to-video's VAE encode at each of its shapes, the device memory outside the allocator, and
one whole pipeline call in plain diffusers as a check; then the folder is deleted (disk).
Each family gets an equal share of what is left of `--total-s`; shapes past its share are
recorded as skipped (the plans list the important ones first).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.lib import merge as merging
from bench.lib import records
from bench.lib.records import RESULTS

from dlo.plan.memory_model import Geometry, Shape, features  # noqa: E402
from dlo.plan.memory_table import TABLE_PATH, FamilyTable, MemoryTable, TableError, fit_linear, part_features  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """What one family measures (largest shapes last within each list: a cut-short run keeps the rest)."""

    preset: str
    transformer: tuple[Shape, ...]
    vae: tuple[Shape, ...]  # decode, plain then tiled
    encode: tuple[Shape, ...] = ()  # image-to-video's VAE encode, plain then tiled
    sequences: tuple[int, ...] = (128, 512)  # text tokens (the limits' max_sequence_length)
    validate: Shape | None = None  # one whole pipeline call (plain diffusers, 2 steps)
    layers: int | None = 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_WAN_T = (Shape(832, 480, 17), Shape(832, 480, 81), Shape(832, 480, 17, 2), Shape(1280, 720, 81),
          Shape(1280, 720, 129), Shape(1920, 1088, 129))
_WAN_VAE = (Shape(832, 480, 5), Shape(832, 480, 17), Shape(1280, 720, 5), Shape(1280, 720, 17),
            Shape(832, 480, 33), Shape(832, 480, 49))
_IMG_T = (Shape(512, 512), Shape(1024, 1024), Shape(1024, 1024, 1, 2), Shape(1536, 1536), Shape(2048, 2048))
_IMG_VAE = (Shape(512, 512), Shape(1024, 1024), Shape(1024, 1024, 1, 2), Shape(1536, 1536), Shape(2048, 2048))
PLANS: dict[str, Plan] = {
    "wan": Plan("wan2.1-t2v-14b", _WAN_T, _WAN_VAE, validate=Shape(832, 480, 17)),
    "wan-i2v": Plan("wan2.1-i2v-14b", _WAN_T[:4], _WAN_VAE[:4],
                    encode=(Shape(832, 480, 17), Shape(832, 480, 33), Shape(1280, 720, 17)),
                    validate=Shape(832, 480, 17)),
    "flux": Plan("flux.1-dev", _IMG_T, _IMG_VAE, validate=Shape(1024, 1024)),
    "qwen-image": Plan("qwen-image", _IMG_T, _IMG_VAE, validate=Shape(1024, 1024)),
}
# the dry run checks the wiring of every step once: one shape per list (CPU, tiny presets)
_TV, _TI = (Shape(32, 32, 5),), (Shape(32, 32),)
TINY_PLANS: dict[str, Plan] = {
    "wan": Plan("tiny-wan2.1-t2v", _TV, _TV, sequences=(16,), validate=_TV[0], layers=None),
    "wan-i2v": Plan("tiny-wan2.1-i2v", _TV, _TV, encode=_TV, sequences=(16,), validate=_TV[0], layers=None),
    "flux": Plan("tiny-flux.1-dev", _TI, _TI, sequences=(16,), validate=_TI[0], layers=None),
    "qwen-image": Plan("tiny-qwen-image", _TI, _TI, sequences=(16,), validate=_TI[0], layers=None),
}


def plans(dry_run: bool) -> dict[str, Plan]:
    return TINY_PLANS if dry_run else PLANS


# ---- run (the GPU host) --------------------------------------------------------------------------
def _make(folder: Path, plan: Plan, device: str, dry_run: bool) -> dict:
    """The pipeline folder: `dlo make-random-model` in a child process on the device (this process
    holds no device memory while the families are measured); in this process for the dry run."""
    if not dry_run:
        from bench.model_folders import make  # the same make (skipped when present) as the pipeline bench

        return make(folder, plan.preset, plan.layers, device)
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    if not (folder / "model_index.json").exists():
        write_pipeline(folder, preset(plan.preset, plan.layers), device="cpu")
    return {"bytes": sum(p.stat().st_size for p in folder.rglob("*.safetensors"))}


def run(args: argparse.Namespace) -> int:
    device = "cpu" if args.dry_run else args.device
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    stem = args.stem or f"raw-memory-{'dry-' if args.dry_run else ''}{datetime.date.today().isoformat()}"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}  # dlo serve's default allocator
    families = args.families.split(",")
    unknown = [f for f in families if f not in PLANS]
    if unknown:
        print(f"bench memory: unknown families {', '.join(unknown)}; known: {', '.join(PLANS)}", file=sys.stderr)
        return 2
    end = time.monotonic() + args.total_s
    failures = 0
    for i, family in enumerate(families):
        plan = plans(args.dry_run)[family]
        folder = args.models / f"{plan.preset}{f'-L{plan.layers}' if plan.layers else ''}"
        raw = args.out / f"{stem}-{family}.json"
        t0 = time.perf_counter()
        made = _make(folder, plan, device, args.dry_run)
        budget = max(10.0, (end - time.monotonic()) / (len(families) - i))
        cmd = [sys.executable, "-m", "bench.memory", "_family", "--family", family, "--model", str(folder), "--raw", str(raw),
               "--device", device, "--budget-s", f"{budget:.0f}"] + (["--dry-run"] if args.dry_run else [])
        print(f"bench memory: {family}: made in {time.perf_counter() - t0:.1f} s ({made.get('bytes', 0) / 1e9:.1f} GB); "
              f"measuring for up to {budget:.0f} s", file=sys.stderr, flush=True)
        try:
            code = subprocess.run(cmd, env=env, timeout=budget + 150).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        _annotate(raw, family, plan, made, code, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        failures += code != 0
        print(f"bench memory: {family}: exit {code} -> {raw}", file=sys.stderr, flush=True)
        if not args.keep_models:
            shutil.rmtree(folder, ignore_errors=True)
    return 1 if failures else 0


def _annotate(raw: Path, family: str, plan: Plan, made: dict, code: Any, alloc_conf: str | None) -> None:
    """The parent's facts of one family's process, added to (or making) its raw record."""
    rec = json.loads(raw.read_text()) if raw.is_file() else {"family": family, "phases": []}
    rec.update(preset=plan.preset, layers=plan.layers, make=made, exit_code=code, date=datetime.date.today().isoformat(),
               alloc_conf_in_environment=alloc_conf, command=" ".join([Path(sys.executable).name, *sys.argv]))
    raw.write_text(json.dumps(rec, indent=1) + "\n")


def family_main(args: argparse.Namespace) -> int:
    """The per-family child: facts of the device and software, then the probe."""
    import torch

    from bench.memory_probe import probe_main

    rec_device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    code = probe_main(args.model, args.raw, args.device, args.budget_s, plans(args.dry_run)[args.family])
    rec = json.loads(args.raw.read_text())
    import diffusers
    import transformers

    rec.update(device_name=rec_device, torch=torch.__version__, diffusers=diffusers.__version__,
               transformers=transformers.__version__, geometry=asdict(_geometry(args.model)))
    records.write(records.raw("memory", args.device, rec), args.raw)
    return code


def _geometry(model: Path) -> Geometry:
    from dlo.engine.families import pipeline_facts

    f = pipeline_facts(model)
    return Geometry(f.size_multiple, f.temporal_factor, f.image_input, f.smallest_side)


# ---- merge (here) ----------------------------------------------------------------------------------
def merge(raws: list[Path], table_path: Path, stem: Path) -> dict:
    """Fit every family's parts (reserved growth: what the table predicts with) and the weights'
    overhead from the raw records; the allocated growth is fitted beside them in the record only."""
    merging.one_card(merging.load(raws))  # one card's table: records of several are refused
    records = [json.loads(p.read_text()) for p in raws]
    dry = [str(p) for p, r in zip(raws, records) if r.get("device_name", r.get("device")) == "cpu"]
    if dry:
        raise TableError(f"{', '.join(dry)}: a CPU dry run measures no device memory; merge GPU records only")
    families: dict[str, FamilyTable] = {}
    overhead: list[tuple[dict, float]] = []
    contexts: list[int] = []
    report: dict[str, Any] = {}
    for rec in records:
        geometry = Geometry(**rec["geometry"])
        video = geometry.temporal_factor > 0
        reserved, allocated = _points(rec, geometry)
        fits, unfitted = _fit_parts(rec["family"], reserved, video)
        activations, _ = _fit_parts(rec["family"], allocated, video)
        families[rec["family"]] = FamilyTable(rec["family"], rec["preset"], fits, rec.get("layers"))
        overhead += [({"bytes": float(ld["expected_bytes"])}, float(ld["reserved"] - ld["expected_bytes"]))
                     for ld in rec.get("loads", {}).values() if "reserved" in ld and ld["expected_bytes"] > 0]
        ctx = rec.get("context_bytes") or {}
        if ctx:
            contexts.append(ctx.get("process_minus_reserved", ctx["device_used_minus_reserved"]))
        report[rec["family"]] = {"validation": _validation(rec, fits, activations, geometry),
                                 "activation_fits": {p: f.to_dict() for p, f in activations.items()},
                                 "skipped": rec.get("skipped", []), "unfitted": unfitted,
                                 "errors": [ph for ph in rec["phases"] if ph.get("error")]}
    table = MemoryTable(families, device=records[0].get("device_name"), source=str(stem.with_suffix(".json")),
                        context_bytes=max(contexts) if contexts else None,
                        weights_overhead=fit_linear(overhead, ("bytes",), "weights_overhead")
                        if len(overhead) >= 2 else None)
    table.write(table_path)
    out = {"sources": [str(p) for p in raws], "table": table.to_dict(), "report": report,
           "command": " ".join([Path(sys.executable).name, *sys.argv])}
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(out))
    return out


Points = dict[str, list[tuple[dict, float]]]


def _points(rec: dict, geometry: Geometry) -> tuple[Points, Points]:
    """Per part: (features, reserved growth) and (features, allocated growth) of every phase that ran."""
    reserved: Points = {}
    allocated: Points = {}
    for ph in rec["phases"]:
        if ph.get("error") or ph.get("peak_allocated") is None or ph["part"] == "pipeline":
            continue
        x = _features(ph, geometry)
        reserved.setdefault(ph["part"], []).append((x, float(ph["peak_reserved"] - ph["base_reserved"])))
        allocated.setdefault(ph["part"], []).append((x, float(ph["peak_allocated"] - ph["base_allocated"])))
    return reserved, allocated


def _fit_parts(family: str, points: Points, video: bool) -> tuple[dict, dict]:
    """The fits, and the parts the call measured too little of (named, left unmeasured)."""
    fits, unfitted = {}, {}
    for part, pts in points.items():
        try:
            fits[part] = fit_linear(pts, part_features(part, video=video), f"{family} {part}")
        except TableError as e:
            unfitted[part] = str(e)
    return fits, unfitted


def _features(ph: dict, geometry: Geometry) -> dict[str, float]:
    shape = Shape(**ph["shape"]) if "shape" in ph else Shape(geometry.size_multiple, geometry.size_multiple)
    return features(ph["part"], shape, geometry, ph.get("sequence", 0))


def _validation(rec: dict, fits: dict, activations: dict, geometry: Geometry) -> dict | None:
    """The whole pipeline call (uncapped: the cache keeps what earlier phases freed) against the
    largest part the fits predict there: reserved growth (what the table predicts with) and allocated."""
    ph = next((p for p in rec["phases"] if p["part"] == "pipeline" and not p.get("error")
               and p.get("peak_allocated") is not None), None)
    if ph is None:
        return None
    shape = Shape(**ph["shape"])
    seq = rec.get("plan", {}).get("sequences", [512])[-1]
    out: dict[str, Any] = {"shape": ph["shape"]}
    for kind, of, measured in (("reserved", fits, ph["peak_reserved"] - ph["base_reserved"]),
                               ("activation", activations, ph["peak_allocated"] - ph["base_allocated"])):
        parts = {part: fit.predict(features(part, shape, geometry, seq)) for part, fit in of.items()
                 if not part.endswith("_tiled")}
        worst = max(parts.values()) if parts else None
        out[kind] = {"measured_bytes": measured, "predicted_parts": parts, "predicted_max_bytes": worst,
                     "measured_over_predicted": round(measured / worst, 4) if worst else None}
    return out


def markdown(out: dict) -> str:
    t = out["table"]
    lines = ["# Device-memory calibration", "", "Generated from the JSON beside it (`bench/memory.py merge`).", "",
             f"Device: {t['device']}; memory outside the allocator: {t['context_bytes']} bytes.", "",
             "Each part: the allocator's reserved growth from an emptied cache (what the table predicts with; "
             "plan/memory_table.py says why), then the allocated growth (the activations) as a check.", "",
             "| family | part | features | reserved: coef (intercept first) | margin | allocated: coef | margin "
             "| points |", "|---|---|---|---|---|---|---|---|"]
    for fam, f in t["families"].items():
        for part, fit in f["parts"].items():
            act = out["report"].get(fam, {}).get("activation_fits", {}).get(part, {"coef": [], "margin": 0.0})
            lines.append(f"| {fam} | {part} | {', '.join(fit['features']) or '-'} | {_coef(fit)} | {fit['margin']:.4g} | "
                         f"{_coef(act)} | {act['margin']:.4g} | {len(fit['points'])} |")
    if t["weights_overhead"]:
        w = t["weights_overhead"]
        lines.append(f"| all | weights_overhead | bytes | {_coef(w)} | {w['margin']:.4g} | - | - | {len(w['points'])} |")
    lines += ["", "## Whole-pipeline check", "", "```json", json.dumps({k: v["validation"] for k, v in
                                                                         out["report"].items()}, indent=1), "```",
              "", "Commands: `" + out["command"] + "`", ""]
    return "\n".join(lines)


def _coef(fit: dict) -> str:
    return ", ".join(f"{c:.4g}" for c in fit["coef"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure on the device (one process per family)")
    r.add_argument("--models", type=Path, default=Path("/tmp/mm"), help="where the reduced pipelines are written")
    r.add_argument("--out", type=Path, required=True, help="folder for the raw records (one per family)")
    r.add_argument("--stem", default=None, help="raw file names: STEM-FAMILY.json (default raw-memory-DATE)")
    r.add_argument("--families", default=",".join(PLANS))
    r.add_argument("--device", default="cuda")
    r.add_argument("--total-s", type=float, default=420.0, help="seconds for every family together (make included)")
    r.add_argument("--keep-models", action="store_true", help="keep the folders (default: delete each after its run)")
    r.add_argument("--dry-run", action="store_true", help="CPU, tiny presets: the wiring only, no result")
    m = sub.add_parser("merge", help="fit the table from raw records (no device)")
    m.add_argument("raws", nargs="+", type=Path)
    m.add_argument("--table", type=Path, default=TABLE_PATH, help=f"the table to write (default {TABLE_PATH})")
    m.add_argument("--out", type=Path, default=RESULTS)
    m.add_argument("--stem", default=f"memory-{datetime.date.today().isoformat()}")
    f = sub.add_parser("_family", help=argparse.SUPPRESS)
    f.add_argument("--family", required=True)
    f.add_argument("--model", type=Path, required=True)
    f.add_argument("--raw", type=Path, required=True)
    f.add_argument("--device", default="cuda")
    f.add_argument("--budget-s", type=float, default=120.0)
    f.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    if args.cmd == "_family":
        return family_main(args)
    try:
        out = merge(args.raws, args.table, args.out / args.stem)
    except (TableError, KeyError, ValueError) as e:
        print(f"bench memory merge: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v["validation"] for k, v in out["report"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
