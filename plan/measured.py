"""Device peaks measured on the device that serves, cached per device, model and library versions.

Owns: `MeasuredPeaks` (a part's reserved growth at an exact shape, as `dlo calibrate --peaks`
measured it on one device: what the memory model takes before the table's fit), its file format
and where it lives (`peaks_path`: `.dlo-peaks/` beside the model's files when the folder is
writable, else the user's cache folder), `load_peaks` and `save_peaks`.
Must never: import torch, or hold a number that was not measured on the device it names (a file
of another device or library versions is another file: it is never read for this one).

The file (JSON): {"version": 1, "device": "NVIDIA H100 80GB HBM3", "versions": "torch 2.11.0 ...",
"model": "<folder's digest>", "points": [{"part": "vae_decode", "width": 832, "height": 480,
"frames": 1, "batch": 1, "bytes": 3380000000}, ...]}; a shape that ran out of the device's memory
is kept as `AtLeast` the device's memory (`"at_least": true`): it does not fit that device, and it is
never a point of a fit between shapes (`dlo.plan.memory_model`), since its true need is unknown.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dlo.plan.memory_model import Shape
from dlo.plan.peak_values import AtLeast

PEAKS_VERSION = 1
PEAKS_FOLDER = ".dlo-peaks"


def _point(p: Mapping[str, Any]) -> int:
    return AtLeast(int(p["bytes"])) if p.get("at_least") else int(p["bytes"])


@dataclass(frozen=True)
class MeasuredPeaks:
    """Reserved growth per (part, shape), measured on `device` with `versions`."""

    device: str
    versions: str
    model: str
    points: Mapping[tuple[str, Shape], int] = field(default_factory=dict)
    seconds: float = 0.0  # what the measuring took

    def get(self, part: str, shape: Shape) -> int | None:
        return self.points.get((part, shape))

    def to_json(self) -> str:
        pts = [{"part": p, "width": s.width, "height": s.height, "frames": s.frames, "batch": s.batch, "bytes": int(b),
                **({"at_least": True} if isinstance(b, AtLeast) else {})}
               for (p, s), b in sorted(self.points.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
        return json.dumps({"version": PEAKS_VERSION, "device": self.device, "versions": self.versions,
                           "model": self.model, "seconds": round(self.seconds, 2), "points": pts}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> "MeasuredPeaks":
        try:
            doc = json.loads(text)
            if doc.get("version") != PEAKS_VERSION:
                raise ValueError(f"version {doc.get('version')!r}, not {PEAKS_VERSION}")
            points = {(p["part"], Shape(int(p["width"]), int(p["height"]), int(p["frames"]), int(p["batch"]))):
                      _point(p) for p in doc["points"]}
            return cls(str(doc["device"]), str(doc["versions"]), str(doc["model"]), points,
                       float(doc.get("seconds", 0.0)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a measured-peaks file ({e})") from None

    def merged(self, other: Mapping[tuple[str, Shape], int], seconds: float = 0.0) -> "MeasuredPeaks":
        return MeasuredPeaks(self.device, self.versions, self.model, {**self.points, **other}, self.seconds + seconds)


def model_digest(model_dir: Path) -> str:
    """What identifies a model's files for its peaks: the VAE's and transformer's names and sizes
    (the shapes their configs give; a re-written folder of other weights keeps them)."""
    h = hashlib.sha256()
    for sub in ("vae", "transformer"):
        for f in sorted((model_dir / sub).glob("*")):
            if f.is_file() and (f.suffix == ".json" or f.suffix == ".safetensors"):
                h.update(f"{sub}/{f.name}:{f.stat().st_size}\n".encode())
                if f.suffix == ".json":
                    h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "device"


def peaks_path(model_dir: Path, device: str, versions: str, cache_root: Path | None = None) -> Path:
    """Where the peaks of `model_dir` on `device` with `versions` live: beside the model's files if
    the folder is writable, else `cache_root` (default `$XDG_CACHE_HOME/dlo/peaks`, `~/.cache/...`)."""
    name = f"{_slug(device)}-{hashlib.sha256(versions.encode()).hexdigest()[:12]}.json"
    if cache_root is None and os.access(model_dir, os.W_OK):
        return model_dir / PEAKS_FOLDER / name
    root = cache_root or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlo" / "peaks"
    return root / f"{_slug(model_dir.resolve().name)}-{model_digest(model_dir)}" / name


def load_peaks(model_dir: Path, device: str, versions: str, cache_root: Path | None = None) -> MeasuredPeaks | None:
    """The peaks measured for this model, device and versions, or None (none yet, or the model's
    files changed since: their digest differs)."""
    path = peaks_path(model_dir, device, versions, cache_root)
    if not path.is_file():
        return None
    peaks = MeasuredPeaks.from_json(path.read_text(), str(path))
    if peaks.device != device or peaks.versions != versions or peaks.model != model_digest(model_dir):
        return None
    return peaks


def save_peaks(model_dir: Path, peaks: MeasuredPeaks, cache_root: Path | None = None) -> Path:
    """Write `peaks` where `load_peaks` reads them (atomically: a temporary file renamed)."""
    path = peaks_path(model_dir, peaks.device, peaks.versions, cache_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(peaks.to_json())
    os.replace(tmp, path)
    return path


def describe(points: Mapping[tuple[str, Shape], int], predicted: Mapping[tuple[str, Shape], Any]) -> list[str]:
    """One line per measured point against what the table predicted for it (bytes, extrapolated)."""
    from dlo.plan.memory_model import format_gb

    out = []
    for (part, shape), measured in sorted(points.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        pred = predicted.get((part, shape))
        if pred is None:
            out.append(f"{part} at {shape}: measured {format_gb(measured)}, the table has none")
            continue
        bytes_, extrapolated = pred
        if isinstance(measured, AtLeast):
            out.append(f"{part} at {shape}: out of memory on this device ({format_gb(measured)}): does not fit, "
                       f"predicted {format_gb(bytes_)}{' (extrapolated)' if extrapolated else ''}")
            continue
        ratio = f"{bytes_ / measured:.2f}x" if measured else "n/a"
        out.append(f"{part} at {shape}: measured {format_gb(measured)}, predicted {format_gb(bytes_)} ({ratio}"
                   f"{', extrapolated' if extrapolated else ''})")
    return out


def phase_needs(memory: Any) -> tuple[dict[str, Any], ...]:
    """Every phase the largest accepted requests run (`PipelineMemory.phases`): the need the plan
    takes and where it comes from (`measured` at that very shape, `measured fit` between shapes
    measured on this device, `table` or `table, extrapolated`), beside the table's own prediction."""
    out = []
    for part, shape in dict.fromkeys(memory.phases()):
        used, table = memory.predicted(part, shape), memory.predicted(part, shape, table_only=True)
        if used is None:
            continue
        if (part, shape) in memory.measured:
            source = "measured"
        elif table is None or used != table:
            source = "measured fit"
        else:
            source = "table, extrapolated" if used[1] else "table"
        out.append({"part": part, "shape": str(shape), "need_bytes": used[0], "source": source,
                    "table_bytes": table[0] if table else None, "table_extrapolated": bool(table and table[1])})
    return tuple(out)


def describe_needs(needs: tuple[dict[str, Any], ...]) -> list[str]:
    """One line per phase need: `transformer at 1920x1920: 12.3 GB measured (the table: 20.1 GB, extrapolated)`."""
    from dlo.plan.memory_model import format_gb

    out = []
    for n in needs:
        table = "" if n["source"].startswith("table") or n["table_bytes"] is None else (
            f" (the table: {format_gb(n['table_bytes'])}{', extrapolated' if n['table_extrapolated'] else ''})")
        out.append(f"{n['part']} at {n['shape']}: {format_gb(n['need_bytes'])} {n['source']}{table}")
    return out
