"""The mode policy: allgather, rank-local or resident, with the numbers and a one-line reason.

Owns: `choose_mode` (docs/contracts.md section 7) over the per-mode estimates of
`dlo.plan.mode_estimates` (their formulas are in its docstring), and `Decision`. Consumers: the
operator (`spec.mode: auto`, most constrained node wins), the engine (`dlo serve --mode auto`)
and `dlo plan`.
Must never: do I/O, log, or import torch. Every input arrives as an argument.

Model facts input: `dlo.plan.facts.ModelFacts`, the one model-facts type of every part (a node
profile's entry converts with `ModelProfile.facts()`, the operator's override with
`ModelFactsOverride.facts()`).

Mode names come from `dlo.plan.facts`: `Decision.mode` and the keys of `Decision.estimates` use
the JSON keys (`ModeKey`: `allgather`, `rank_local`, `resident`); `Decision.engine_mode` gives the
engine's and the CLI's spelling (`Mode`: `rank-local`).

Choice: resident when it fits the device; else the fastest mode that fits; near-ties (within
`NEAR_TIE` of the fastest) go to rank-local, which couples no ranks. Nothing fits: `NoModeFits` (a
`PolicyError`), carrying the estimates and naming the smallest device budget that would fit (and,
with a measured pipeline, the largest `--max-size` that would); inputs that describe no
deployment: a plain `PolicyError`.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from dlo.plan.mode_estimates import (
    BYTES_PER_PARAM,
    DEVICE_RESERVE_RATIO,
    FRAMEWORK_BASE_BYTES,
    FRAMEWORK_MODEL_RATIO,
    NEAR_TIE,
    ModeEstimate,
    NoModeFits,
    PolicyError,
    block_time,
    rank_budget,
    devices_are_host,
    runnable,
    block_compute_time,
    device_budget,
    estimate_modes,
    framework_bytes,
    host_needed,
)
from dlo.plan.profile import NodeProfile
from dlo.plan.facts import Mode, ModeKey, ModelFacts, mode_of_key
from dlo.plan.limits_fit import largest_fitting_size
from dlo.plan.memory_model import SLOT_ALIGN, padded_shard_bytes
from dlo.plan.memory_model import format_gb as _gb

if TYPE_CHECKING:
    from dlo.plan.memory_model import PipelineMemory

__all__ = ["BYTES_PER_PARAM", "DEVICE_RESERVE_RATIO", "FRAMEWORK_BASE_BYTES", "FRAMEWORK_MODEL_RATIO", "NEAR_TIE",
           "SLOT_ALIGN", "Decision", "ModeEstimate", "NoModeFits", "PolicyError", "block_compute_time",
           "choose_mode", "device_budget", "estimate_modes", "framework_bytes", "padded_shard_bytes"]


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    mode: ModeKey
    reason: str
    estimates: dict[ModeKey, ModeEstimate]
    device_budget_bytes: int | None = None  # what one rank may use of its device (None: host ranks)

    @property
    def engine_mode(self) -> Mode:
        """The mode as `dlo serve --mode` spells it."""
        return mode_of_key(self.mode)

    def plan_json(self) -> dict:
        """The `dlo plan --json` document (docs/contracts.md section 7)."""
        return {
            "choice": {"mode": self.mode, "reason": self.reason},
            "device_budget_bytes": self.device_budget_bytes,
            "modes": {name: est.model_dump() for name, est in self.estimates.items()},
        }


@dataclass(frozen=True)
class _Ask:
    """One `choose_mode` question with its estimates: what the named steps below read."""

    profile: NodeProfile
    model: ModelFacts
    g: int
    est: dict[ModeKey, ModeEstimate]
    headroom: int
    budget: int | None
    workload: str
    pipeline: PipelineMemory | None

    def bound(self, name: str) -> str:
        """What bounds `name`'s time per block (or why it is unknown)."""
        p = self.profile
        return block_time(name, self.est["resident"].block_seconds or 0.0, self.model.largest_block_bytes, self.g,
                           p.h2d_bandwidth_bps, p.interconnect.collective_bandwidth_bps, devices_are_host(p))[1]

    def decide(self, mode: ModeKey, reason: str) -> Decision:
        return Decision(mode=mode, reason=reason, estimates=self.est, device_budget_bytes=self.budget)


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
    device_budget_bytes: int | None = None,
    pipeline: PipelineMemory | None = None,
) -> Decision:
    """Pick the mode for `dp x sp` ranks on a node described by `profile` (module docstring).
    `device_budget_bytes`: a cap on what one rank may use of its device (`--max-device-memory`);
    `pipeline`: the whole pipeline's memory at the deployment's limits (else the transformer's)."""
    est = estimate_modes(
        profile, model, dp, sp, tokens_per_rank, host_headroom_bytes, block_compute_seconds=block_compute_seconds,
        require_bandwidth=require_bandwidth, device_budget_bytes=device_budget_bytes, pipeline=pipeline,
    )
    on_host = devices_are_host(profile)
    ask = _Ask(profile, model, dp * sp, est, host_headroom_bytes,
               None if on_host else rank_budget(profile, device_budget_bytes, pipeline),
               "" if tokens_per_rank is not None or block_compute_seconds is not None
               else " (no workload given: weight movement only)", pipeline)
    if est["resident"].fits:
        return ask.decide("resident", _resident_reason(ask))
    feasible = [name for name in ("allgather", "rank_local") if est[name].fits]
    if not feasible:
        raise NoModeFits(_nothing_fits(ask), est)
    if len(feasible) == 1:
        return _the_only_one(ask, feasible[0])
    return _the_fastest(ask)


def _resident_reason(ask: _Ask) -> str:
    if ask.budget is None:
        return (f"the model ({_gb(ask.model.bytes)}) fits host memory ({_gb(ask.profile.host_memory_bytes)}) "
                "on every rank: no offload needed")
    e = ask.est["resident"]
    what = "the pipeline" if ask.pipeline is not None else "the model"
    peak = f", {_gb(e.device_peak_bytes)} at the largest accepted request" if e.device_peak_bytes is not None else ""
    return f"{what} ({_gb(e.device_weight_bytes)}{peak}) fits one device (budget {_gb(ask.budget)}): no offload needed"


def _the_only_one(ask: _Ask, only: ModeKey) -> Decision:
    other: ModeKey = "rank_local" if only == "allgather" else "allgather"
    seconds = ask.est[only].block_seconds
    at = f"at {_ms(seconds)} per block{ask.workload}" if seconds is not None else f"time per block {ask.bound(only)}"
    return ask.decide(only, f"{other} does not fit ({_why_not(ask, other)}); {only} does, {at}")


def _the_fastest(ask: _Ask) -> Decision:
    """Both offload modes fit: the faster, rank-local on a near-tie, allgather when times are unknown."""
    unknown = [ask.bound(name) for name in ("allgather", "rank_local") if ask.est[name].block_seconds is None]
    if unknown:
        return ask.decide("allgather", "allgather and rank-local both fit; time per block " + unknown[0]
                          + ", so the one with the least host and device memory: allgather")
    ag, rl = ask.est["allgather"].block_seconds or 0.0, ask.est["rank_local"].block_seconds or 0.0
    if rl <= ag * (1 + NEAR_TIE):
        verdict = "ties with" if rl > ag else "is no slower than"
        return ask.decide("rank_local", f"rank-local ({_ms(rl)} per block) {verdict} allgather ({_ms(ag)}) within "
                          f"{NEAR_TIE:.0%}: no cross-rank coupling{ask.workload}")
    return ask.decide("allgather", f"allgather over {ask.g} ranks takes {_ms(ag)} per block vs rank-local {_ms(rl)} "
                      f"({ask.bound('allgather')}, rank-local {ask.bound('rank_local')}){ask.workload}")


def _nothing_fits(ask: _Ask) -> str:
    """Why no mode fits, and the smallest device budget (or the largest --max-size) that would."""
    text = f"no mode fits: {_why_not(ask, 'allgather')}; {_why_not(ask, 'rank_local')}"
    host_fits = [n for n in ("rank_local", "allgather") if runnable(n, ask.g, ask.profile)
                 and _device_need(ask.est[n]) is not None and not _host_short(ask, n)]
    if ask.budget is None or not host_fits:
        return text
    best = min(host_fits, key=lambda n: _device_need(ask.est[n]) or 0)
    text += f"; the smallest device budget that fits is {_gb(_device_need(ask.est[best]))} ({mode_of_key(best)})"
    if ask.pipeline is not None and ask.est[best].device_peak_bytes is not None:
        side = largest_fitting_size(ask.pipeline, best, ask.g, ask.budget)
        if side is not None:
            text += f", or limits up to --max-size {side} at this budget"
    return text


def _device_need(e: ModeEstimate) -> int | None:
    """The device budget a mode needs: its predicted peak, else its weights over the reserve ratio."""
    return e.device_peak_bytes if e.device_peak_bytes is not None else int(
        math.ceil(e.device_weight_bytes / (1 - DEVICE_RESERVE_RATIO)))


def _host_short(ask: _Ask, name: ModeKey) -> bool:
    """Whether `name` fails on host memory (whatever the device budget)."""
    return host_needed(ask.profile, ask.model, ask.g, ask.est[name]) > ask.profile.host_memory_bytes - ask.headroom


def _why_not(ask: _Ask, name: ModeKey) -> str:
    e = ask.est[name]
    if not runnable(name, ask.g, ask.profile):
        return f"{name} has no collective path between the devices"
    if not _host_short(ask, name) and ask.budget is not None:
        if e.device_peak_bytes is not None:
            rank = ask.pipeline.rank(name, ask.g) if ask.pipeline is not None else None
            return (f"{name} needs {_gb(e.device_peak_bytes)} per device ({rank.describe() if rank else ''}), "
                    f"over the device budget of {_gb(ask.budget)}")
        return (f"{name} needs {_gb(e.device_weight_bytes)} of weights per device, over "
                f"{_gb(ask.budget * (1 - DEVICE_RESERVE_RATIO))} ({1 - DEVICE_RESERVE_RATIO:.0%} of the device budget "
                f"of {_gb(ask.budget)})")
    if ask.budget is None and e.device_weight_bytes * ask.g > ask.profile.host_memory_bytes - ask.headroom:
        return (f"{name} needs {_gb(e.device_weight_bytes)} of weights per device, over "
                f"{_gb(ask.profile.host_memory_bytes - ask.headroom)}")
    return (
        f"{name} needs {_gb(e.pinned_host_bytes)} pinned host memory with "
        f"{_gb(e.page_cache_bytes)} page cache, over {_gb(ask.profile.host_memory_bytes - ask.headroom)} host RAM"
    )


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"
