"""The node profile: what one node offers DLO (docs/contracts.md section 6).

Owns: the `NodeProfile` schema (pydantic, `version: "v1"`) that the agent publishes as the JSON value
of node annotation `dlo.dev/node-profile` and at `/profile`, plus the nominal figures (H2D and
collective bandwidth, dense bf16 compute rate) used when `dlo calibrate` has measured nothing.
Consumers: the operator (`spec.mode: auto`), the engine (`--mode auto`), `dlo plan`, the policy.
Must never: do I/O or import torch. Reading the host is `dlo.agent.topology`'s job; this module only
describes and validates.

Unknown fields are ignored when parsing an annotation, so an older reader accepts a newer agent's
annotation. Files a person gives on the command line (`dlo plan --profile`, `--calibration`,
`dlo operator render --profile`) are read with `parse_file`, which rejects unknown keys by name: a
typo there would otherwise silently fall back to a default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlo.plan.facts import InterconnectKind, ModelFacts, Vendor

PROFILE_VERSION = "v1"
ANNOTATION = "dlo.dev/node-profile"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ProfileError(ValueError):
    """A profile or calibration file that cannot be used; the message is one line naming the key."""


class Accelerator(_Model):
    vendor: Vendor = "none"
    model: str = ""
    count: int = Field(0, ge=0)
    memory_bytes: int = Field(0, ge=0, description="memory of ONE device")
    # What one rank may use of ONE device (a smaller device, or room left for something else): the
    # policy plans with the smallest of this, memory_bytes and `--max-device-memory`. None: all of it.
    budget_bytes: int | None = Field(None, ge=1, description="device budget of ONE device (None: its memory)")
    # Dense bf16 rate one device sustains in a DiT block; None: take the nominal figure of `model`.
    bf16_flops: float | None = Field(None, gt=0)


class Interconnect(_Model):
    kind: InterconnectKind = "none"
    collective_bandwidth_bps: int = Field(0, ge=0, description="AllGather bus bandwidth, bytes/s")


class PcieLink(_Model):
    generation: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)


class ModelProfile(_Model):
    """One entry of `NodeProfile.models` (keyed by the model's folder name under the models root):
    the wire form of `dlo.plan.facts.ModelFacts` plus the folder's page-cache residency.

    The JSON shape is a contract (docs/contracts.md section 6: flat `bytes`, `largest_block_bytes`,
    `blocks`, `nonblock_bytes`, `resident_ratio`), so the facts are not nested. Convert with
    `ModelProfile.of(facts, resident_ratio)` and `.facts()`; nothing else builds one from the other.
    The model family is not on the wire (`facts().family` is "").
    """

    bytes: int = Field(
        ge=0,
        description="safetensors bytes of the transformer only (what the policy moves); the whole "
        "folder with VAE and text encoders is the agent metric dlo_model_bytes",
    )
    largest_block_bytes: int = Field(ge=0)
    blocks: int = Field(ge=0)
    nonblock_bytes: int = Field(0, ge=0)
    resident_ratio: float | None = Field(
        None, ge=0, le=1,
        description="page-cache residency of every safetensors file of the folder, 0..1 "
        "(dlo_model_page_cache_resident_ratio)",
    )

    @classmethod
    def of(cls, facts: ModelFacts, resident_ratio: float | None = None) -> "ModelProfile":
        """The profile entry of a model with `facts` and the given residency."""
        return cls(
            bytes=facts.bytes,
            largest_block_bytes=facts.largest_block_bytes,
            blocks=facts.blocks,
            nonblock_bytes=facts.nonblock_bytes,
            resident_ratio=resident_ratio,
        )

    def facts(self) -> ModelFacts:
        """The model facts this entry carries (what `dlo.plan.policy` takes)."""
        return ModelFacts(
            bytes=self.bytes,
            largest_block_bytes=self.largest_block_bytes,
            blocks=self.blocks,
            nonblock_bytes=self.nonblock_bytes,
        )


class ModelErrorProfile(_Model):
    """One entry of `NodeProfile.model_errors`: a model folder that cannot be loaded (truncated,
    unreadable, ...; dlo.agent.modelcheck). Such a folder has no `models` entry."""

    reason: str = Field(description="one of dlo.agent.modelcheck.REASONS (the dlo_model_error reason label)")
    message: str = Field("", description="what is wrong, naming the file")


class NodeProfile(_Model):
    version: Literal["v1"] = PROFILE_VERSION
    node: str = ""
    accelerator: Accelerator = Accelerator()
    interconnect: Interconnect = Interconnect()
    pcie: PcieLink | None = None
    h2d_bandwidth_bps: int = Field(0, ge=0, description="pinned host-to-device copy, bytes/s")
    host_memory_bytes: int = Field(0, ge=0)
    numa_nodes: int = Field(1, ge=0)
    can_register_page_cache: bool = False
    # True when the bandwidths come from a `dlo calibrate` fragment, False when nominal.
    measured: bool = False
    models: dict[str, ModelProfile] = Field(default_factory=dict)
    # Optional (absent when none; older readers ignore it): model folders that cannot be loaded,
    # keyed by folder name. A broken folder is never in `models` (its facts and residency are unknown).
    model_errors: dict[str, ModelErrorProfile] | None = None

    def to_annotation(self) -> str:
        """The compact JSON value of the `dlo.dev/node-profile` node annotation."""
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def from_annotation(cls, value: str) -> "NodeProfile":
        return cls.model_validate_json(value)


_M = TypeVar("_M", bound=BaseModel)


def parse_file(model: type[_M], text: str, where: str) -> _M:
    """`text` (JSON written by a person) as `model`, rejecting keys the model does not know.

    Every problem is a `ProfileError` with a one-line message that starts with `where` (the file).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: not JSON ({e})") from None
    unknown = unknown_keys(model, data)
    if unknown:
        listed = ", ".join(f"{key!r} (known there: {', '.join(known)})" for key, known in unknown)
        raise ProfileError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {listed}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'document'}: {err['msg']}" for err in e.errors()
        )
        raise ProfileError(f"{where}: {problems}") from None


def unknown_keys(model: type[BaseModel], data: Any, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Dotted paths of the keys in `data` that `model` (and its nested models) do not define, each
    with the keys that would be known at that place."""
    if not isinstance(data, dict):
        return []
    out: list[tuple[str, list[str]]] = []
    known = list(model.model_fields)
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            out.append((f"{prefix}{key}", known))
            continue
        nested, mapping = _nested_model(field.annotation)
        if nested is None:
            continue
        if mapping and isinstance(value, dict):
            for name, item in value.items():
                out += unknown_keys(nested, item, f"{prefix}{key}.{name}.")
        elif not mapping:
            out += unknown_keys(nested, value, f"{prefix}{key}.")
    return out


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(model, is a dict of it) for `Model`, `Model | None` and `dict[str, Model]`; else (None, False)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if get_origin(annotation) is dict:
        value = get_args(annotation)[1]
        return (value, True) if isinstance(value, type) and issubclass(value, BaseModel) else (None, False)
    for arg in get_args(annotation):  # Optional / unions
        found = _nested_model(arg)
        if found[0] is not None:
            return found
    return None, False


class CalibrationFragment(_Model):
    """What `dlo calibrate --out FILE` writes (docs/contracts.md section 2); both fields optional."""

    h2d_bandwidth_bps: int | None = Field(None, gt=0)
    collective_bandwidth_bps: int | None = Field(None, gt=0)


def apply_calibration(profile: NodeProfile, fragment: CalibrationFragment) -> NodeProfile:
    """The profile with measured bandwidths from `fragment` (marked `measured` if any was given)."""
    update: dict[str, object] = {}
    if fragment.h2d_bandwidth_bps is not None:
        update["h2d_bandwidth_bps"] = fragment.h2d_bandwidth_bps
    if fragment.collective_bandwidth_bps is not None:
        update["interconnect"] = profile.interconnect.model_copy(
            update={"collective_bandwidth_bps": fragment.collective_bandwidth_bps}
        )
    if not update:
        return profile
    update["measured"] = True
    return profile.model_copy(update=update)


# Nominal figures by device model, used when nothing was measured. Matching is by substring of
# the model name the driver reports (NVML `nvmlDeviceGetName`, npu-smi "Name"), first hit wins.
# H2D: achievable pinned copy rate of the host link (PCIe 5 x16 measured at 55.3 GB/s on an H200;
# PCIe 4 x16 ~ 25 GB/s). Collective: achievable AllGather bus bandwidth of the fabric (about 80-90%
# of the link's unidirectional rate). bf16: dense GEMM rate sustained in practice (738 TFLOP/s
# measured on an H200), not the datasheet peak.
NOMINAL: tuple[tuple[str, int, int, float], ...] = (
    # (model substring, h2d B/s, collective B/s over the native fabric, bf16 FLOP/s)
    ("B300", 55_000_000_000, 720_000_000_000, 1_800e12),
    ("B200", 55_000_000_000, 720_000_000_000, 1_700e12),
    ("H200", 55_300_000_000, 360_000_000_000, 738e12),
    ("H100", 50_000_000_000, 360_000_000_000, 700e12),
    ("H800", 50_000_000_000, 160_000_000_000, 700e12),
    ("A100", 25_000_000_000, 240_000_000_000, 250e12),
    ("A800", 25_000_000_000, 160_000_000_000, 250e12),
    ("L40S", 25_000_000_000, 0, 300e12),
    ("910B", 25_000_000_000, 56_000_000_000, 280e12),
    ("910", 25_000_000_000, 30_000_000_000, 250e12),
)
# Unknown devices: PCIe 4 x16 copies, PCIe peer-to-peer collectives, a modest compute rate.
DEFAULT_H2D_BPS = 25_000_000_000
PCIE_COLLECTIVE_BPS = {3: 10_000_000_000, 4: 20_000_000_000, 5: 40_000_000_000, 6: 80_000_000_000}
DEFAULT_PCIE_COLLECTIVE_BPS = 20_000_000_000
DEFAULT_BF16_FLOPS = 100e12


def _nominal_row(device_model: str) -> tuple[str, int, int, float] | None:
    name = device_model.upper()
    for row in NOMINAL:
        if row[0] in name:
            return row
    return None


def nominal_h2d_bps(device_model: str) -> int:
    row = _nominal_row(device_model)
    return row[1] if row else DEFAULT_H2D_BPS


def nominal_collective_bps(device_model: str, kind: InterconnectKind, pcie_generation: int | None = None) -> int:
    """Nominal AllGather bandwidth: the fabric's figure for NVLink/HCCS, PCIe peer-to-peer otherwise."""
    if kind == "none":
        return 0
    if kind in ("nvlink", "hccs"):
        row = _nominal_row(device_model)
        if row and row[2]:
            return row[2]
    return PCIE_COLLECTIVE_BPS.get(pcie_generation or 0, DEFAULT_PCIE_COLLECTIVE_BPS)


def nominal_bf16_flops(device_model: str) -> float:
    row = _nominal_row(device_model)
    return row[3] if row else DEFAULT_BF16_FLOPS


def compute_rate(accelerator: Accelerator) -> float:
    """FLOP/s the policy assumes for one device: the profile's figure, else the nominal one."""
    return accelerator.bf16_flops or nominal_bf16_flops(accelerator.model)


def profile_from_file(profile: NodeProfile, path: Path) -> NodeProfile:
    """A file a person gave: a whole NodeProfile (the agent's /profile) or a `dlo calibrate`
    fragment applied to `profile`; any problem in it is an error (ProfileError)."""
    text = path.read_text()
    try:
        whole = isinstance(data := json.loads(text), dict) and "version" in data
    except ValueError:
        whole = False  # parse_file says what is wrong with it
    if whole:
        return parse_file(NodeProfile, text, str(path))
    return apply_calibration(profile, parse_file(CalibrationFragment, text, str(path)))
