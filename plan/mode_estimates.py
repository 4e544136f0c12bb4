"""The per-mode estimates behind the mode policy: memory, fit and time per block.

Owns: `estimate_modes` (what `dlo.plan.policy.choose_mode` decides over), `ModeEstimate`, the
device budget (`device_budget`), the framework-memory fit, the per-block time model, and the
policy's errors (`PolicyError`, `NoModeFits`). Consumers: `dlo.plan.policy` (which re-exports
every public name here: docs/contracts.md section 7 names them there).
Must never: do I/O, log, or import torch. Every input arrives as an argument.

Time model, per block, with `S` the largest block's bytes, `g = dp * sp` ranks sharing the weights
on the node, `B_h2d` the pinned host-to-device rate of one device and `B_coll` the AllGather bus
bandwidth (copy, gather and compute run on separate streams and overlap, so the slowest wins):

- rank-local: `max(t_c, S / B_h2d)` - every rank copies the whole block over its own link.
- allgather:  `max(t_c, S / (g * B_h2d), S * (g - 1) / (g * B_coll))` - each rank copies 1/g and
  receives the other (g-1)/g through the collective.
- resident:   `t_c` - no weight moves.

`t_c` is the block's compute time: `block_compute_seconds` when given, else estimated from
`tokens_per_rank` as `(2 * P * T + 4 * T**2 * H) / R` with `P = S / 2` parameters (bf16),
`H = sqrt(P / 12)` the hidden size of a transformer block with that many parameters, and `R` the
device's dense bf16 rate (`dlo.plan.profile.compute_rate`). Checked against a Wan2.1-14B block
(0.703 GB) on an H200 (R = 738 TFLOP/s): 4.4 ms estimated vs 4.6 ms measured at 4,096 tokens,
63 ms vs 71 ms at 32,760 tokens. With neither given, `t_c = 0`: the modes are compared on weight
movement alone and the reason says so.

Memory model (bytes; `M` model bytes, `g` ranks on the node):

- page cache: `M` in every mode (all ranks map the same files: one shared copy).
- pinned host: allgather `M` per node (g shards of M/g); rank-local `g * M`, or `M` when the
  platform can register the page cache for DMA (`can_register_page_cache`: no copy at all);
  resident 0.
- cold-start peak the pod cgroup sees: page cache + pinned that the cgroup sees + `g * F(M)`.
  Pinned the cgroup sees: none when the pinned bytes ARE the page cache (registered) and none on
  Ascend (driver DMA memory is not charged to the cgroup); the arena otherwise.
- per-rank framework `F(M) = FRAMEWORK_BASE_BYTES + FRAMEWORK_MODEL_RATIO * M` (runtime, private
  non-block weights, communicator buffers). Least-squares fit to the published cold-start cgroup
  peaks (Ascend, so no pinned bytes visible): Nano 33 GB at DP4 47 GB (model: 47.0), Super 124 GB
  at DP2 157 GB (model: 149.8, -4.6%) and at DP4 172 GB (model: 175.6, +2.1%).
- host RAM needed (physical, whatever the cgroup sees): page cache + pinned not already in the page
  cache + `g * F(M)`; a mode fits the host when that is <= host memory - `host_headroom_bytes`.
- device weight bytes per rank: resident `M`; allgather two slots of `g * S_pad` (`S_pad` =
  ceil(S / g) rounded up to 256 B, docs/contracts.md section 4) plus non-block bytes; rank-local two
  slots of `S` plus non-block bytes (`dlo.plan.memory_model.placed_weight_bytes`). With the
  pipeline's memory (`pipeline`: `dlo serve`, `dlo plan --model PIPELINE_DIR`) the weights are the
  whole pipeline's (text encoders streamed or whole, VAE, image encoders) and the device peak adds
  what the largest request the limits accept needs, from the measured table
  (`dlo.plan.memory_model`).
- the device budget: the smallest of one device's memory (less what lives outside the allocator,
  when measured), the profile's `accelerator.budget_bytes` and `device_budget_bytes` (`dlo serve
  --max-device-memory`, `dlo plan --max-device-memory`, `spec.engine.maxDeviceMemory`). A mode fits
  the device when its predicted peak is within the budget; where the table has no measurement for
  the family (or no pipeline is known), when its weights take at most `1 - DEVICE_RESERVE_RATIO` of
  the budget (the rest: activations, allocator, comms). Never resident above the budget.
  A node without accelerators (CPU ranks) holds every rank's "device" weights in host RAM: they
  count into the host total and the host budget is the device budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from dlo.plan.profile import NodeProfile, compute_rate
from dlo.plan.facts import MODE_KEYS, ModeKey, ModelFacts
from dlo.plan.memory_model import placed_weight_bytes
from dlo.plan.memory_plan import UNMEASURED_RESERVE_RATIO

if TYPE_CHECKING:
    from dlo.plan.memory_model import PipelineMemory

FRAMEWORK_BASE_BYTES = 91_000_000
FRAMEWORK_MODEL_RATIO = 0.1033
DEVICE_RESERVE_RATIO = UNMEASURED_RESERVE_RATIO  # the budget kept for an unmeasured request (one constant with auto resident blocks)
NEAR_TIE = 0.05
BYTES_PER_PARAM = 2


class PolicyError(ValueError):
    """No mode fits, or the inputs cannot describe a deployment. Carries the estimates when known."""

    def __init__(self, message: str, estimates: "dict[ModeKey, ModeEstimate] | None" = None):
        super().__init__(message)
        self.estimates = estimates or {}


class NoModeFits(PolicyError):
    """The inputs are valid but no mode fits the node's memory (the estimates say by how much)."""


class ModeEstimate(BaseModel):
    model_config = ConfigDict(frozen=True)

    pinned_host_bytes: int
    page_cache_bytes: int
    cold_start_peak_bytes: int
    device_weight_bytes: int  # the whole pipeline's when it is known, else the transformer's
    block_seconds: float | None  # None: the mode cannot run here (allgather without a collective path)
    fits: bool
    # weights + the largest accepted request + allocator reserve (the measured table); None: unmeasured
    device_peak_bytes: int | None = None


def framework_bytes(model_bytes: int) -> int:
    """Per-rank framework memory `F(M)` of the memory model."""
    return int(FRAMEWORK_BASE_BYTES + FRAMEWORK_MODEL_RATIO * model_bytes)


def block_compute_time(profile: NodeProfile, block_bytes: int, tokens_per_rank: int) -> float:
    """Estimated seconds one device spends computing one block over `tokens_per_rank` tokens."""
    params = block_bytes / BYTES_PER_PARAM
    hidden = math.sqrt(params / 12)
    flops = 2 * params * tokens_per_rank + 4 * tokens_per_rank**2 * hidden
    return flops / compute_rate(profile.accelerator)


def device_budget(profile: NodeProfile, cap: int | None = None, outside_allocator: int = 0) -> int:
    """Bytes one rank may use of its device: the device's memory (less `outside_allocator`, what the
    CUDA context holds when measured), the profile's `budget_bytes` and `cap`, the smallest."""
    acc = profile.accelerator
    return min([acc.memory_bytes - outside_allocator, *(b for b in (acc.budget_bytes, cap) if b)])


def _check_inputs(profile: NodeProfile, model: ModelFacts, dp: int, sp: int, require_bandwidth: bool) -> None:
    if not isinstance(model, ModelFacts):
        raise TypeError(f"model must be a dlo.plan.facts.ModelFacts, not {type(model).__name__}")
    if dp < 1 or sp < 1:
        raise PolicyError(f"dp and sp must be >= 1 (got dp={dp}, sp={sp})")
    if model.bytes <= 0 or model.largest_block_bytes <= 0:
        raise PolicyError(
            f"model facts need positive bytes and largest_block_bytes (got {model.bytes}, "
            f"{model.largest_block_bytes})"
        )
    if require_bandwidth and profile.h2d_bandwidth_bps <= 0:
        raise PolicyError("the node profile has no h2d_bandwidth_bps: give a profile or a calibration")


@dataclass(frozen=True)
class _Device:
    """Per mode: device weights, predicted peak (None: unmeasured) and whether it fits the budget."""

    weights: int
    peak: int | None
    fits: bool


def _device(name: ModeKey, model: ModelFacts, g: int, budget: int | None, pipeline: PipelineMemory | None) -> _Device:
    if pipeline is None:
        weights, peak = placed_weight_bytes(model, name, g), None
    else:
        rank = pipeline.rank(name, g)
        weights, peak = rank.weights_bytes, rank.peak_bytes
    if budget is None:  # host ranks: the host budget decides
        return _Device(weights, None, True)
    fits = peak <= budget if peak is not None else weights <= budget * (1 - DEVICE_RESERVE_RATIO)
    return _Device(weights, peak, fits)


def estimate_modes(
    profile: NodeProfile,
    model: ModelFacts,
    dp: int,
    sp: int = 1,
    tokens_per_rank: int | None = None,
    host_headroom_bytes: int = 0,
    *,
    block_compute_seconds: float | None = None,
    require_bandwidth: bool = True,
    device_budget_bytes: int | None = None,
    pipeline: PipelineMemory | None = None,
) -> dict[ModeKey, ModeEstimate]:
    """Memory and time per mode (see the module docstring for every formula)."""
    _check_inputs(profile, model, dp, sp, require_bandwidth)
    g = dp * sp
    m = model.bytes
    s = model.largest_block_bytes
    on_host = devices_are_host(profile)
    t_c = _compute_seconds(profile, s, tokens_per_rank, block_compute_seconds)
    b_h2d, b_coll = profile.h2d_bandwidth_bps, profile.interconnect.collective_bandwidth_bps
    registered = profile.can_register_page_cache
    invisible_pinned = profile.accelerator.vendor == "ascend"
    pinned = {"allgather": m, "rank_local": m if registered else g * m, "resident": 0}
    framework = g * framework_bytes(m)
    host_budget = profile.host_memory_bytes - host_headroom_bytes
    budget = None if on_host else rank_budget(profile, device_budget_bytes, pipeline)
    out: dict[ModeKey, ModeEstimate] = {}
    for name in MODE_KEYS:
        # CPU ranks: the table is the accelerators'; their "device" weights are host memory, one set per rank
        dev = _device(name, model, g, budget, None if on_host else pipeline)
        # Registered pinned memory is the page cache itself; an arena is a second copy (the cgroup
        # sees it, except Ascend's driver DMA memory).
        visible_pinned = 0 if registered or invisible_pinned else pinned[name]
        e = ModeEstimate(
            pinned_host_bytes=pinned[name],
            page_cache_bytes=m,
            cold_start_peak_bytes=m + visible_pinned + framework,
            device_weight_bytes=dev.weights,
            block_seconds=block_time(name, t_c, s, g, b_h2d, b_coll, on_host)[0],
            fits=False,
            device_peak_bytes=dev.peak,
        )
        fits = runnable(name, g, profile) and host_needed(profile, model, g, e) <= host_budget and dev.fits
        out[name] = e.model_copy(update={"fits": fits})
    return out


def rank_budget(profile: NodeProfile, cap: int | None, pipeline: PipelineMemory | None) -> int:
    return device_budget(profile, cap, pipeline.context_bytes if pipeline is not None else 0)


def devices_are_host(profile: NodeProfile) -> bool:
    """No accelerator: ranks compute in host memory, so "device" memory is host RAM."""
    return profile.accelerator.vendor == "none" or profile.accelerator.memory_bytes == 0


def runnable(mode: str, g: int, profile: NodeProfile) -> bool:
    """False only for allgather over several accelerators with no collective path between them."""
    no_path = profile.interconnect.collective_bandwidth_bps <= 0 and not devices_are_host(profile)
    return not (mode == "allgather" and g > 1 and no_path)


def block_time(
    mode: str, t_c: float, s: int, g: int, b_h2d: int, b_coll: int, on_host: bool
) -> tuple[float | None, str]:
    """Seconds per block of `mode` and what bounds it (compute, H2D or collective); None and why
    when the mode cannot run or a bandwidth it needs is unknown."""
    terms: dict[str, float] = {"compute": t_c}
    if mode in ("rank_local", "allgather") and b_h2d <= 0:
        return None, "unknown: the profile has no H2D bandwidth"
    if mode == "rank_local":
        terms["H2D"] = s / b_h2d
    elif mode == "allgather":
        terms["H2D"] = s / (g * b_h2d)
        if g > 1:
            if b_coll <= 0:
                if on_host:
                    return None, "unknown: the profile has no collective bandwidth between host ranks"
                return None, "no collective path between the devices"
            terms["collective"] = s * (g - 1) / (g * b_coll)
    bound = max(terms, key=lambda k: terms[k])
    return terms[bound], f"{bound}-bound"


def _compute_seconds(
    profile: NodeProfile, block_bytes: int, tokens_per_rank: int | None, block_compute_seconds: float | None
) -> float:
    if block_compute_seconds is not None:
        if block_compute_seconds < 0:
            raise PolicyError(f"block_compute_seconds must be >= 0 (got {block_compute_seconds})")
        return block_compute_seconds
    if tokens_per_rank is not None:
        if tokens_per_rank < 1:
            raise PolicyError(f"tokens_per_rank must be >= 1 (got {tokens_per_rank})")
        return block_compute_time(profile, block_bytes, tokens_per_rank)
    return 0.0


def host_needed(profile: NodeProfile, model: ModelFacts, g: int, e: ModeEstimate) -> int:
    """Host RAM a mode needs (the fit's left side): page cache, pinned not in it, framework, and on
    CPU ranks every rank's "device" weights."""
    extra_pinned = 0 if profile.can_register_page_cache else e.pinned_host_bytes
    weights = g * e.device_weight_bytes if devices_are_host(profile) else 0
    return e.page_cache_bytes + extra_pinned + g * framework_bytes(model.bytes) + weights
