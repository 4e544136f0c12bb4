"""Step-cache presets: the caches a request may ask for, by name, with their parameters, validated.

Owns: the presets (`FirstBlock`, `TaylorSeer`, `Mag`: each one of diffusers' own cache hooks, named
and with the parameters a request may set), `CacheSpec` (any of them), `cache_spec` (a request's,
a flag's or a spec's value -> a preset, None, or `CacheSpecError` naming the field), `cache_dict`
(a preset as plain JSON data, the inverse of `cache_spec`) and `listing` (every preset with its
defaults, for `GET /v1/models`).
Must never: import torch or diffusers (the HTTP side and the operator validate with it), or build
a cache (`dlo.engine.step_cache` builds diffusers' configs from these and enables them per request).

What each preset skips (docs/engine.md, "Step caches"): `first-block` (diffusers' FirstBlockCache)
runs the first block of every call and, where its output changed less than `threshold` since the
last full call, none of the others; `taylorseer` (diffusers' TaylorSeer in its lite form: every
block of a predicted step is skipped, the output projection extrapolated) runs full steps on a fixed
schedule; `mag` (diffusers' MagCache) skips whole calls while the accumulated error its
`mag_ratios` predict stays under `threshold`. A preset's defaults are diffusers' own.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal, Union, get_args

from dlo.plan.errors import ConfigError

FactorsDtype = Literal["bfloat16", "float32"]
FACTORS_DTYPES: tuple[FactorsDtype, ...] = get_args(FactorsDtype)
MAX_RATIOS = 1000  # mag_ratios entries: one per step of the calibration run
MAX_ORDER = 4  # taylorseer's max_order: its factors are kept up to this order
NONE = "none"  # a request's way to ask for no cache where the server has a default


class CacheSpecError(ConfigError):
    """A cache that is no valid preset; `param` is the field at fault (`cache` or `cache.NAME`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _at(where: str, name: str) -> str:
    """The field `name` of `where` (a request's `cache`: "cache.threshold"; a flag's value: "threshold")."""
    return f"{where}.{name}" if where else name


def _number(where: str, name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (open_low and value == low):
        span = f"{'>' if open_low else '>='} {low:g} and <= {high:g}"
        raise CacheSpecError(f"{_at(where, name)} must be a number {span}, got {value!r}", _at(where, name))
    return float(value)


def _integer(where: str, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CacheSpecError(f"{_at(where, name)} must be an integer from {low} to {high}, got {value!r}",
                             _at(where, name))
    return value


@dataclass(frozen=True)
class FirstBlock:
    """diffusers' FirstBlockCache: the first block always runs; the rest only where its residual moved
    more than `threshold` (relative mean absolute difference) since the last call that ran them."""

    preset: ClassVar[str] = "first-block"
    threshold: float = 0.05

    def check(self, where: str) -> None:
        _number(where, "threshold", self.threshold, 0.0, 10.0, open_low=True)


@dataclass(frozen=True)
class TaylorSeer:
    """diffusers' TaylorSeer, lite form: the first `disable_cache_before_step` steps and every
    `cache_interval`-th after run in full, the others skip every block and extrapolate the output
    projection to order `max_order` (factors kept in `factors_dtype`); from
    `disable_cache_after_step` on (if set) every step runs in full."""

    preset: ClassVar[str] = "taylorseer"
    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    factors_dtype: FactorsDtype = "bfloat16"

    def check(self, where: str) -> None:
        _integer(where, "cache_interval", self.cache_interval, 1, 1000)
        # step 0 must run in full: diffusers' prediction needs a computed step before it
        _integer(where, "disable_cache_before_step", self.disable_cache_before_step, 1, 10000)
        if self.disable_cache_after_step is not None:
            _integer(where, "disable_cache_after_step", self.disable_cache_after_step, 1, 10000)
        _integer(where, "max_order", self.max_order, 0, MAX_ORDER)
        if self.factors_dtype not in FACTORS_DTYPES:
            raise CacheSpecError(f"{_at(where, 'factors_dtype')} must be one of {', '.join(FACTORS_DTYPES)}, "
                                 f"got {self.factors_dtype!r}", _at(where, "factors_dtype"))


@dataclass(frozen=True)
class Mag:
    """diffusers' MagCache: after the first `retention_ratio` of the steps, a call is skipped whole
    (its output: its input plus the last residual) while the error the model's `mag_ratios` (one per
    step of a calibration run, interpolated to the request's steps) accumulate stays under
    `threshold`, at most `max_skip_steps` in a row."""

    preset: ClassVar[str] = "mag"
    mag_ratios: tuple[float, ...] = ()
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2

    def check(self, where: str) -> None:
        if not isinstance(self.mag_ratios, (tuple, list)) or not 2 <= len(self.mag_ratios) <= MAX_RATIOS:
            raise CacheSpecError(f"{_at(where, 'mag_ratios')} must be a list of 2 to {MAX_RATIOS} numbers (the model's "
                                 f"magnitude ratios per step, from a calibration run), got {self.mag_ratios!r}"[:300],
                                 _at(where, "mag_ratios"))
        for i, r in enumerate(self.mag_ratios):
            _number(where, f"mag_ratios[{i}]", r, 0.0, 100.0, open_low=True)
        _number(where, "threshold", self.threshold, 0.0, 10.0, open_low=True)
        _integer(where, "max_skip_steps", self.max_skip_steps, 1, 1000)
        _number(where, "retention_ratio", self.retention_ratio, 0.0, 1.0)


CacheSpec = Union[FirstBlock, TaylorSeer, Mag]
PRESETS: dict[str, type] = {cls.preset: cls for cls in (FirstBlock, TaylorSeer, Mag)}


def cache_spec(value: Any, where: str = "cache") -> CacheSpec | None:
    """A cache as a request, `dlo serve --cache` or `spec.engine.cache` gives it: a preset's name
    (its defaults), an object `{"preset": NAME, PARAMETER: VALUE, ...}`, or that object as JSON text;
    None or "none": no cache. Anything else is a `CacheSpecError` naming the field (`where`...)."""
    if value is None or isinstance(value, (FirstBlock, TaylorSeer, Mag)):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise CacheSpecError(f"{where or 'the cache'} is not a preset name or a JSON object: {e}",
                                     where) from None
        elif text == NONE:
            return None
        else:
            value = {"preset": text}
    if not isinstance(value, dict):
        raise CacheSpecError(f"{where or 'the cache'} must be a preset name ({', '.join(PRESETS)} or {NONE}) or an "
                             f"object {{\"preset\": NAME, ...}}, got {type(value).__name__}", where)
    name = value.get("preset")
    if name == NONE and len(value) == 1:
        return None
    cls = PRESETS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CacheSpecError(f"{_at(where, 'preset')} must be one of {', '.join(PRESETS)} (or {NONE}), got {name!r}",
                             _at(where, "preset"))
    known = {f.name for f in fields(cls)}
    for key in value:
        if key != "preset" and key not in known:
            raise CacheSpecError(f"{_at(where, key)} is no parameter of preset {name!r}; it takes "
                                 f"{', '.join(sorted(known))}", _at(where, key))
    params = {k: v for k, v in value.items() if k != "preset"}
    if cls is Mag:
        if "mag_ratios" not in params:
            raise CacheSpecError(f"{_at(where, 'mag_ratios')} is required by preset 'mag' (the model's magnitude "
                                 "ratios per step, from a calibration run)", _at(where, "mag_ratios"))
        if isinstance(params["mag_ratios"], list):
            params["mag_ratios"] = tuple(params["mag_ratios"])
    spec = cls(**params)
    spec.check(where)
    return spec


def cache_dict(spec: CacheSpec | None) -> dict[str, Any] | None:
    """`spec` as plain JSON data (`cache_spec` reads it back); None for none."""
    if spec is None:
        return None
    data = asdict(spec)
    if "mag_ratios" in data:
        data["mag_ratios"] = list(data["mag_ratios"])
    return {"preset": spec.preset, **data}


def listing(default: CacheSpec | None) -> dict[str, Any]:
    """What `GET /v1/models` says of the caches: every preset with its parameters' defaults (None:
    required), and the server's default (`dlo serve --cache`; a request's `cache` overrides it)."""
    presets = {}
    for name, cls in PRESETS.items():
        params = {}
        for f in fields(cls):
            default_value = f.default
            params[f.name] = None if cls is Mag and f.name == "mag_ratios" else default_value
        presets[name] = params
    return {"presets": presets, "default": cache_dict(default)}
