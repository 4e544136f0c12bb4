"""The mode policy: allgather, rank-local or resident, with the numbers and a one-line reason.

Owns: `choose_mode` (CONTRACTS.md section 7), the per-mode memory model and the per-block time
model. Consumers: the operator (`spec.mode: auto`, most constrained node wins), the engine
(`dlo serve --mode auto`) and `dlo plan`.
Must never: do I/O, log, or import torch. Every input arrives as an argument.

Model facts input: `dlo.engine.facts.ModelFacts`, the one model-facts type of every part (a node
profile's entry converts with `ModelProfile.facts()`, the operator's override with
`ModelFactsOverride.facts()`).

Mode names come from `dlo.engine.facts`: `Decision.mode` and the keys of `Decision.estimates` use
the JSON keys (`ModeKey`: `allgather`, `rank_local`, `resident`); `Decision.engine_mode` gives the
engine's and the CLI's spelling (`Mode`: `rank-local`).

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
device's dense bf16 rate (`dlo.agent.profile.compute_rate`). Checked against a Wan2.1-14B block
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
  ceil(S / g) rounded up to 256 B, CONTRACTS.md section 4) plus non-block bytes; rank-local two
  slots of `S` plus non-block bytes. A mode fits the device when its weights take at most
  `1 - DEVICE_RESERVE_RATIO` of one device's memory (the rest: activations, allocator, comms).
  A node without accelerators (CPU ranks) holds every rank's "device" weights in host RAM: they
  count into the host total and the host budget is the device budget.

Choice: resident when it fits the device; else the fastest mode that fits; near-ties (within
`NEAR_TIE` of the fastest) go to rank-local, which couples no ranks. Nothing fits: `NoModeFits` (a
`PolicyError`), carrying the estimates; inputs that describe no deployment: a plain `PolicyError`.

Unknown bandwidth: the memory model needs no bandwidth, the time model does. By default a profile
without `h2d_bandwidth_bps` is a `PolicyError` (the engine then falls back to its fixed rule, the
operator skips the node). With `require_bandwidth=False` (`dlo plan`), the offload modes get
`block_seconds = None` ("n/a") but `fits` is still decided on memory; among offload modes that fit
with an unknown time the choice is allgather, the least host and device memory, and the reason says
the times are unknown. On a node without accelerators the ranks gather through host memory (gloo),
so a missing collective bandwidth there leaves allgather's time unknown; on accelerators it means
there is no collective path and allgather cannot run (`block_seconds = None`, `fits = False`).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from dlo.agent.profile import NodeProfile, compute_rate
from dlo.engine.facts import MODE_KEYS, Mode, ModeKey, ModelFacts, mode_of_key

FRAMEWORK_BASE_BYTES = 91_000_000
FRAMEWORK_MODEL_RATIO = 0.1033
DEVICE_RESERVE_RATIO = 0.15
NEAR_TIE = 0.05
BYTES_PER_PARAM = 2
SLOT_ALIGN = 256


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
    device_weight_bytes: int
    block_seconds: float | None  # None: the mode cannot run here (allgather without a collective path)
    fits: bool


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    mode: ModeKey
    reason: str
    estimates: dict[ModeKey, ModeEstimate]

    @property
    def engine_mode(self) -> Mode:
        """The mode as `dlo serve --mode` spells it."""
        return mode_of_key(self.mode)

    def plan_json(self) -> dict:
        """The `dlo plan --json` document (CONTRACTS.md section 7)."""
        return {
            "choice": {"mode": self.mode, "reason": self.reason},
            "modes": {name: est.model_dump() for name, est in self.estimates.items()},
        }


def framework_bytes(model_bytes: int) -> int:
    """Per-rank framework memory `F(M)` of the memory model."""
    return int(FRAMEWORK_BASE_BYTES + FRAMEWORK_MODEL_RATIO * model_bytes)


def padded_shard_bytes(block_bytes: int, g: int) -> int:
    """`S_pad`: ceil(block / g) rounded up to 256 bytes (CONTRACTS.md section 4)."""
    shard = -(-block_bytes // g)
    return -(-shard // SLOT_ALIGN) * SLOT_ALIGN


def block_compute_time(profile: NodeProfile, block_bytes: int, tokens_per_rank: int) -> float:
    """Estimated seconds one device spends computing one block over `tokens_per_rank` tokens."""
    params = block_bytes / BYTES_PER_PARAM
    hidden = math.sqrt(params / 12)
    flops = 2 * params * tokens_per_rank + 4 * tokens_per_rank**2 * hidden
    return flops / compute_rate(profile.accelerator)


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
) -> dict[ModeKey, ModeEstimate]:
    """Memory and time per mode (see the module docstring for every formula)."""
    if not isinstance(model, ModelFacts):
        raise TypeError(f"model must be a dlo.engine.facts.ModelFacts, not {type(model).__name__}")
    if dp < 1 or sp < 1:
        raise PolicyError(f"dp and sp must be >= 1 (got dp={dp}, sp={sp})")
    if model.bytes <= 0 or model.largest_block_bytes <= 0:
        raise PolicyError(
            f"model facts need positive bytes and largest_block_bytes (got {model.bytes}, "
            f"{model.largest_block_bytes})"
        )
    if require_bandwidth and profile.h2d_bandwidth_bps <= 0:
        raise PolicyError("the node profile has no h2d_bandwidth_bps: give a profile or a calibration")
    g = dp * sp
    m = model.bytes
    s = model.largest_block_bytes
    nonblock = model.nonblock_bytes
    t_c = _compute_seconds(profile, s, tokens_per_rank, block_compute_seconds)
    b_h2d = profile.h2d_bandwidth_bps
    b_coll = profile.interconnect.collective_bandwidth_bps
    on_host = _devices_are_host(profile)
    times = {name: _block_time(name, t_c, s, g, b_h2d, b_coll, on_host)[0] for name in MODE_KEYS}
    registered = profile.can_register_page_cache
    invisible_pinned = profile.accelerator.vendor == "ascend"
    pinned = {
        "allgather": m,
        "rank_local": m if registered else g * m,
        "resident": 0,
    }
    device = {
        "allgather": 2 * g * padded_shard_bytes(s, g) + nonblock,
        "rank_local": 2 * s + nonblock,
        "resident": m,
    }
    framework = g * framework_bytes(m)
    host_budget = profile.host_memory_bytes - host_headroom_bytes
    device_budget = host_budget if on_host else _device_budget(profile)
    out: dict[ModeKey, ModeEstimate] = {}
    for name in MODE_KEYS:
        # Registered pinned memory is the page cache itself; an arena is a second copy.
        extra_pinned = 0 if registered else pinned[name]
        visible_pinned = 0 if invisible_pinned else extra_pinned
        # CPU ranks: "device" weights (slots, resident blocks) are host memory too, one set per rank.
        host_needed = m + extra_pinned + framework + (g * device[name] if on_host else 0)
        out[name] = ModeEstimate(
            pinned_host_bytes=pinned[name],
            page_cache_bytes=m,
            cold_start_peak_bytes=m + visible_pinned + framework,
            device_weight_bytes=device[name],
            block_seconds=times[name],
            fits=_runnable(name, g, profile) and host_needed <= host_budget and device[name] <= device_budget,
        )
    return out


def _devices_are_host(profile: NodeProfile) -> bool:
    """No accelerator: ranks compute in host memory, so "device" memory is host RAM."""
    return profile.accelerator.vendor == "none" or profile.accelerator.memory_bytes == 0


def _device_budget(profile: NodeProfile) -> float:
    return profile.accelerator.memory_bytes * (1 - DEVICE_RESERVE_RATIO)


def _runnable(mode: str, g: int, profile: NodeProfile) -> bool:
    """False only for allgather over several accelerators with no collective path between them."""
    no_path = profile.interconnect.collective_bandwidth_bps <= 0 and not _devices_are_host(profile)
    return not (mode == "allgather" and g > 1 and no_path)


def _block_time(
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


def choose_mode(
    profile: NodeProfile,
    model: ModelFacts,
    dp: int,
    sp: int = 1,
    tokens_per_rank: int | None = None,
    host_headroom_bytes: int = 0,
    *,
    block_compute_seconds: float | None = None,
    require_bandwidth: bool = True,
) -> Decision:
    """Pick the mode for `dp x sp` ranks on a node described by `profile` (module docstring)."""
    est = estimate_modes(
        profile, model, dp, sp, tokens_per_rank, host_headroom_bytes,
        block_compute_seconds=block_compute_seconds, require_bandwidth=require_bandwidth,
    )
    g = dp * sp
    b_h2d, b_coll = profile.h2d_bandwidth_bps, profile.interconnect.collective_bandwidth_bps
    on_host = _devices_are_host(profile)
    t_c = est["resident"].block_seconds or 0.0
    workload = (
        "" if tokens_per_rank is not None or block_compute_seconds is not None
        else " (no workload given: weight movement only)"
    )
    if est["resident"].fits:
        return Decision(
            mode="resident",
            reason=(
                f"the model ({_gb(model.bytes)}) fits host memory ({_gb(profile.host_memory_bytes)}) "
                "on every rank: no offload needed"
                if _devices_are_host(profile)
                else f"the model ({_gb(model.bytes)}) fits one device "
                f"({_gb(profile.accelerator.memory_bytes)}): no offload needed"
            ),
            estimates=est,
        )
    feasible = [name for name in ("allgather", "rank_local") if est[name].fits]
    if not feasible:
        raise NoModeFits(
            f"no mode fits: {_why_not(est, 'allgather', profile, host_headroom_bytes, g)}; "
            f"{_why_not(est, 'rank_local', profile, host_headroom_bytes, g)}",
            est,
        )
    if len(feasible) == 1:
        only = feasible[0]
        other: ModeKey = "rank_local" if only == "allgather" else "allgather"
        seconds = est[only].block_seconds
        at = (
            f"at {_ms(seconds)} per block{workload}" if seconds is not None
            else f"time per block {_block_time(only, t_c, model.largest_block_bytes, g, b_h2d, b_coll, on_host)[1]}"
        )
        return Decision(
            mode=only,
            reason=f"{other} does not fit ({_why_not(est, other, profile, host_headroom_bytes, g)}); {only} does, {at}",
            estimates=est,
        )
    unknown = [
        _block_time(name, t_c, model.largest_block_bytes, g, b_h2d, b_coll, on_host)[1]
        for name in feasible if est[name].block_seconds is None
    ]
    if unknown:
        return Decision(
            mode="allgather",
            reason="allgather and rank-local both fit; time per block " + unknown[0]
            + ", so the one with the least host and device memory: allgather",
            estimates=est,
        )
    ag, rl = est["allgather"].block_seconds or 0.0, est["rank_local"].block_seconds or 0.0
    if rl <= ag * (1 + NEAR_TIE):
        verdict = "ties with" if rl > ag else "is no slower than"
        return Decision(
            mode="rank_local",
            reason=f"rank-local ({_ms(rl)} per block) {verdict} allgather ({_ms(ag)}) within "
            f"{NEAR_TIE:.0%}: no cross-rank coupling{workload}",
            estimates=est,
        )
    return Decision(
        mode="allgather",
        reason=f"allgather over {g} ranks takes {_ms(ag)} per block vs rank-local {_ms(rl)} "
        f"({_block_time('allgather', t_c, model.largest_block_bytes, g, b_h2d, b_coll, on_host)[1]}, rank-local "
        f"{_block_time('rank_local', t_c, model.largest_block_bytes, g, b_h2d, b_coll, on_host)[1]}){workload}",
        estimates=est,
    )


def _why_not(est: dict[ModeKey, ModeEstimate], name: ModeKey, profile: NodeProfile, headroom: int, g: int) -> str:
    e = est[name]
    if not _runnable(name, g, profile):
        return f"{name} has no collective path between the devices"
    budget = profile.host_memory_bytes - headroom if _devices_are_host(profile) else _device_budget(profile)
    if e.device_weight_bytes > budget:
        return f"{name} needs {_gb(e.device_weight_bytes)} of weights per device, over {_gb(int(budget))}"
    return (
        f"{name} needs {_gb(e.pinned_host_bytes)} pinned host memory with "
        f"{_gb(e.page_cache_bytes)} page cache, over {_gb(profile.host_memory_bytes - headroom)} host RAM"
    )


def _gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB"


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"
