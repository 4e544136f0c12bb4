"""The committed table of measured device-memory peaks, and the fits between its shapes.

Owns: the table format (`MemoryTable`, `FamilyTable`, `Fit`; the file `memory_table.json` beside
this module, written only by `python -m bench memory merge` from a GPU call's raw results), the
least-squares fit of one part's peaks over its shapes (`fit_linear`), and the features a part's
peak is fitted in (`part_features`). Read by `dlo.plan.memory_model`.
Must never: import torch, or hold a number that was not measured: until a family is calibrated
its entry is absent and the model calls it unmeasured (no default, no guess).

Parts and their fits (bytes beyond the weights, per phase: the allocator's reserved growth from an
emptied cache, `peak reserved - reserved before`; the allocated growth is fitted too, in the merged
record, as a check):
- `transformer`: one forward (a CFG branch is its own call), linear in `tokens` = batch x latent
  frames x (W / s) x (H / s) with `s` the size multiple (VAE scale x patch): with flash attention
  every activation is proportional to the tokens; the text tokens sit in the intercept (measured
  at the longest sequence).
- `vae_decode`, `vae_decode_tiled`, `vae_encode`, `vae_encode_tiled` (image-to-video's first
  frame): video families linear in `area` = batch x W x H (the working set of one causal frame
  chunk) and `pixels` = area x frames (the output the chunks accumulate); image families in
  `pixels` alone. Decode includes the pipeline's post-processing to numpy.
- text encoders by component name (`text_encoder`, `text_encoder_2`): linear in `sequence` (the
  limits' max_sequence_length; a family's prompt template is added when measured).
- `image_encoder`: a constant (a fixed 224x224 input).
Why reserved growth: it is what the phase needed the allocator to hold, fragmentation included, and
it bounds what the phase needs under a cap (`--max-device-memory`, or a smaller device): before an
allocation fails, the caching allocator frees its cached segments and retries, so a capped run never
holds more than the uncapped one did. A table-wide "reserve over the activations" line (version 1)
mixed parts whose reserve ratio runs from 0.2 (Qwen-Image's VAE) to 1.3 (Flux's transformer); its
largest residual (8.0 GB, Flux's VAE decode at 2048x2048) was added to every prediction.
`weights_overhead`: what a component's load reserves beyond its weight bytes (allocator rounding,
small tensors in 2 MB segments), linear in `bytes`.
Each fit is the least-squares line shifted up by its largest under-prediction (`margin`), so it
bounds every measured point; a prediction outside the measured range says so (`extrapolated`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

TABLE_PATH = Path(__file__).with_name("memory_table.json")
TABLE_VERSION = 2
VAE_PARTS = ("vae_decode", "vae_decode_tiled", "vae_encode", "vae_encode_tiled")


class TableError(ValueError):
    """A table or a set of points that does not make a fit; the message names the part."""


def part_features(part: str, *, video: bool) -> tuple[str, ...]:
    """The features (beside the intercept) a part's peak is fitted in (module docstring)."""
    if part == "transformer":
        return ("tokens",)
    if part in VAE_PARTS:
        return ("area", "pixels") if video else ("pixels",)
    if part == "image_encoder":
        return ()
    if part == "weights_overhead":
        return ("bytes",)
    if part.startswith("text_encoder"):
        return ("sequence",)
    raise TableError(f"unknown memory part {part!r}")


@dataclass(frozen=True)
class Fit:
    """`bytes = coef[0] + sum(coef[i + 1] * x[features[i]]) + margin`, never below `margin`."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    margin: float
    span: Mapping[str, tuple[float, float]]  # the measured range of each feature
    points: tuple[tuple[Mapping[str, float], float], ...] = ()

    def predict(self, x: Mapping[str, float]) -> int:
        missing = [f for f in self.features if f not in x]
        if missing:
            raise TableError(f"a prediction needs {', '.join(missing)}")
        value = self.coef[0] + sum(c * x[f] for c, f in zip(self.coef[1:], self.features))
        return int(max(0.0, value) + self.margin + 0.5)

    def extrapolated(self, x: Mapping[str, float]) -> bool:
        """Whether `x` lies outside the measured range of any feature."""
        return any(not lo <= x[f] <= hi for f, (lo, hi) in self.span.items())

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(self.features), "coef": list(self.coef), "margin": self.margin,
                "span": {k: list(v) for k, v in self.span.items()},
                "points": [[dict(x), y] for x, y in self.points]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Fit":
        try:
            features = tuple(data["features"])
            coef = tuple(float(c) for c in data["coef"])
            if len(coef) != len(features) + 1:
                raise TableError(f"{len(coef)} coefficients for {len(features)} features (+ the intercept)")
            return cls(features, coef, float(data["margin"]),
                       {k: (float(v[0]), float(v[1])) for k, v in data.get("span", {}).items()},
                       tuple((dict(x), float(y)) for x, y in data.get("points", [])))
        except (KeyError, TypeError, IndexError) as e:
            raise TableError(f"a fit does not parse: {e!r}") from None


def fit_linear(points: list[tuple[Mapping[str, float], float]], features: tuple[str, ...], part: str) -> Fit:
    """The least-squares fit of `y` over `1, x[features...]`, shifted up to bound every point."""
    n = len(features) + 1
    if len(points) < n:
        raise TableError(f"{part}: {len(points)} measured point(s) cannot fit {n} coefficients "
                         f"({', '.join(('1',) + features)}); measure more shapes")
    # columns scaled to 1 so the normal equations stay well conditioned (tokens ~1e5, pixels ~1e9)
    scale = [1.0] + [max(abs(x[f]) for x, _ in points) or 1.0 for f in features]
    rows = [[1.0] + [x[f] / s for f, s in zip(features, scale[1:])] for x, _ in points]
    ys = [float(y) for _, y in points]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    beta = _solve(ata, aty, part, features)
    coef = tuple(b / s for b, s in zip(beta, scale))
    fitted = [coef[0] + sum(c * x[f] for c, f in zip(coef[1:], features)) for x, _ in points]
    margin = max(0.0, max(y - max(0.0, f) for y, f in zip(ys, fitted)))
    span = {f: (min(x[f] for x, _ in points), max(x[f] for x, _ in points)) for f in features}
    return Fit(features, coef, margin, span, tuple((dict(x), y) for x, y in points))


def _solve(a: list[list[float]], b: list[float], part: str, features: tuple[str, ...]) -> list[float]:
    """Gaussian elimination with partial pivoting (at most a few unknowns)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in m[pivot][:n])):
            raise TableError(f"{part}: the measured shapes do not vary {', '.join(features) or 'anything'} "
                             "independently; measure shapes that do")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            k = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= k * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


@dataclass(frozen=True)
class FamilyTable:
    """One family's measured parts (fits by part name) and what they were measured on."""

    family: str
    preset: str
    parts: Mapping[str, Fit]
    layers: int | None = None  # the block count of the measured model (activations do not depend on it)

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "layers": self.layers,
                "parts": {name: fit.to_dict() for name, fit in sorted(self.parts.items())}}


@dataclass(frozen=True)
class MemoryTable:
    """The whole table: per family, plus what holds for every family on the measured device."""

    families: Mapping[str, FamilyTable] = field(default_factory=dict)
    device: str | None = None  # the device the rows were measured on
    source: str | None = None  # the record the rows were merged from
    # device memory outside the caching allocator (CUDA context, loaded kernels): a real device of
    # M bytes leaves M - context_bytes to the allocator (a --max-device-memory cap is the allocator's own)
    context_bytes: int | None = None
    # what a component's load reserves beyond its weight bytes, per component (`bytes`: its weights)
    weights_overhead: Fit | None = None

    def family(self, name: str) -> FamilyTable | None:
        return self.families.get(name)

    def overhead(self, weight_bytes: int) -> int:
        """The reserved bytes a component of `weight_bytes` takes beyond them (0 when unmeasured)."""
        if self.weights_overhead is None or weight_bytes <= 0:
            return 0
        return self.weights_overhead.predict({"bytes": float(weight_bytes)})

    def to_dict(self) -> dict[str, Any]:
        return {"version": TABLE_VERSION, "device": self.device, "source": self.source,
                "context_bytes": self.context_bytes,
                "weights_overhead": self.weights_overhead.to_dict() if self.weights_overhead else None,
                "families": {name: fam.to_dict() for name, fam in sorted(self.families.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "memory table") -> "MemoryTable":
        if data.get("version") != TABLE_VERSION:
            raise TableError(f"{where}: version {data.get('version')!r}; this build reads version {TABLE_VERSION}")
        known = {"version", "device", "source", "context_bytes", "weights_overhead", "families"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TableError(f"{where}: unknown keys {', '.join(unknown)}")
        try:
            families = {name: FamilyTable(name, str(f["preset"]), {p: Fit.from_dict(v) for p, v in f["parts"].items()},
                                          f.get("layers"))
                        for name, f in (data.get("families") or {}).items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise TableError(f"{where}: a family entry does not parse: {e!r}") from None
        overhead = data.get("weights_overhead")
        return cls(families, data.get("device"), data.get("source"), data.get("context_bytes"),
                   Fit.from_dict(overhead) if overhead else None)

    @classmethod
    def load(cls, path: Path | str = TABLE_PATH) -> "MemoryTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), str(path))
        except (OSError, json.JSONDecodeError) as e:
            raise TableError(f"{path}: cannot read the memory table ({e})") from None

    def write(self, path: Path | str = TABLE_PATH) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
