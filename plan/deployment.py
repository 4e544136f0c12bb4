"""The deployment plan: one entry, `plan(...) -> DeploymentPlan`, for `dlo serve`, `dlo plan` and
the operator.

Owns: `PlanAsk` (what a deployment asks: ranks, mode, device budget, resident blocks, how weights
stream, CFG pairs, LoRA), `DeploymentPlan` (the frozen answer: the mode, the device budget, the VAE
decode rule, the resident blocks per streamed model, the accepted limits, the LoRA merge cache, the
predicted peak per phase, and every decision's reason in words), `plan` (the decisions in order:
budget, decode rule, mode, resident blocks, merge cache) and `plan_folder` (the same from a pipeline
folder: its facts and memory at the limits read first).
Must never: import torch or read the host (the caller passes the node's profile and the device's
memory), or refuse on a guess (`dlo.plan.budget.check_mode`).

The order, and why: the decode rule is mode-independent (its reference is the leanest placement), so
it comes first and every mode plans with it; the mode is checked (given) or chosen (auto, by the
policy over the same pipeline memory); the resident blocks fill what the budget leaves beside the
largest accepted request in that mode; an auto LoRA merge cache takes what is spare after them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from dlo.plan.budget import LORA_COMPONENT, DeviceBudgetError, check_mode, deployment_memory, local_budget
from dlo.plan.facts import DeviceKind, Mode, ModelFacts, ModeOrAuto
from dlo.plan.limits import Limits
from dlo.plan.memory_model import PipelineMemory, Shape, format_gb
from dlo.plan.measured import phase_needs
from dlo.plan.memory_plan import resident_plan, spare_bytes, tiling_for_budget
from dlo.plan.policy import Decision, ModeEstimate
from dlo.plan.profile import NodeProfile
from dlo.plan.resident import NO_TILING, VAE_TILE_ABOVE_PIXELS, ResidentPlan, VaeTiling

log = logging.getLogger(__name__)

LoraApply = Literal["auto", "merge", "branch"]


@dataclass(frozen=True)
class LoraAsk:
    """The LoRA adapters a deployment serves, as the plan needs them (none by default)."""

    adapter_bytes: int = 0  # what every rank holds for them (tensors and merge scratch)
    merges_bytes: int = 0  # every adapter's merges: the most an auto merge cache could hold
    apply: LoraApply = "auto"
    merge_cache: int | Literal["auto"] = "auto"  # bytes, 0 (none), or what the budget has spare
    merge_above_tokens: int | None = None  # `--lora-merge-above` (None: by the cache)
    served: bool = False  # a `--lora-dir` is given (its adapters may be none yet)


@dataclass(frozen=True)
class Workload:
    """What the policy's time estimates may use (`dlo plan`'s flags; none by default: weight
    movement only) and the host memory kept free."""

    tokens_per_rank: int | None = None
    block_compute_seconds: float | None = None
    host_headroom_bytes: int = 0
    require_bandwidth: bool = True  # False: memory and fit are answered without a bandwidth


@dataclass(frozen=True)
class PlanAsk:
    """What a deployment asks of the plan: the one place the device budget has a name
    (`max_device_memory`, bytes per rank; 0: the device's memory)."""

    dp: int = 1
    sp: int = 1
    mode: ModeOrAuto = "auto"
    device: DeviceKind = "cpu"
    max_device_memory: int = 0
    resident_blocks: int | Literal["auto"] = 0
    stream_dtype: str = "bfloat16"
    stream_encoders: bool = True
    cfg_pairs: bool = True  # asked; the waiting lane counts only at sp 1, where pairs may run
    vae_tiling: VaeTiling = "auto"  # `--vae-tiling`: auto (only where plain cannot fit), always, never
    measured: Mapping[tuple[str, Shape], int] = field(default_factory=dict)  # peaks measured on the device
    lora: LoraAsk = field(default_factory=LoraAsk)
    workload: Workload = field(default_factory=lambda: Workload())

    @property
    def world(self) -> int:
        return self.dp * self.sp

    @property
    def pairs_counted(self) -> bool:
        """Whether the waiting CFG-pairs lane is counted: asked, and at sp 1 (pairs never run above)."""
        return self.cfg_pairs and self.sp == 1


@dataclass(frozen=True)
class DeploymentPlan:
    """What a deployment runs, decided once, with the reason of each decision."""

    mode: Mode
    mode_reason: str
    dp: int
    sp: int
    device: DeviceKind
    budget_bytes: int | None  # per rank; None: no accelerator budget (cpu ranks)
    vae_tile_above_pixels: int  # decoded pixels above which the VAE decodes in tiles
    tiling_reason: str
    vae_tiling: VaeTiling  # never: a request above the threshold is refused, not tiled
    resident: ResidentPlan | None  # `--resident-blocks auto` resolved (None: not auto, or no budget)
    resident_blocks: Mapping[str, int]  # per streamed model: blocks kept on the device
    limits: Limits | None  # the largest request accepted (None: a transformer alone, no pipeline)
    lora_merge_cache_bytes: int | None  # an auto cache sized (None: no adapters, or a size given)
    lora_merge_above_tokens: int | None  # with a budget, auto merges above this (None: as given)
    weights_bytes: int | None  # a rank's placed weights in the mode (None: no pipeline memory)
    peaks: Mapping[str, int]  # phase -> a rank's predicted peak (weights + the phase's need)
    reasons: tuple[str, ...]  # every decision in words, in the order made
    # per phase of the largest requests: the need taken, its source (measured or the table), the table's
    needs: tuple[Mapping[str, Any], ...] = ()
    decision: Decision | None = None  # the policy's answer, its estimates per mode (auto only)
    policy_error: str | None = None  # why the policy gave no answer (auto only; the fixed rule then)

    @property
    def estimates(self) -> Mapping[str, ModeEstimate]:
        return self.decision.estimates if self.decision is not None else {}

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON (`dlo plan --json`'s "plan", `/ready`'s "plan")."""
        return {
            "mode": self.mode, "mode_reason": self.mode_reason, "dp": self.dp, "sp": self.sp, "device": self.device,
            "budget_bytes": self.budget_bytes,
            "vae": {"tile_above_pixels": self.vae_tile_above_pixels, "reason": self.tiling_reason,
                    "tiling": self.vae_tiling},
            "resident_blocks": dict(self.resident_blocks),
            "limits": self.limits.model_dump() if self.limits is not None else None,
            "lora": {"merge_cache_bytes": self.lora_merge_cache_bytes,
                     "merge_above_tokens": self.lora_merge_above_tokens},
            "weights_bytes": self.weights_bytes,
            "predicted_peak_bytes": dict(self.peaks),
            "needs": [dict(n) for n in self.needs],
            "reasons": list(self.reasons),
        }

    def describe(self) -> str:
        """One line for a log: the mode, the budget, the resident blocks and the decode rule."""
        kept = ", ".join(f"{n} {k}" for n, k in self.resident_blocks.items()) or "none"
        budget = format_gb(self.budget_bytes) if self.budget_bytes is not None else "none (cpu)"
        vae = ("every decode plain" if self.vae_tile_above_pixels >= NO_TILING
               else f"vae tiled above {self.vae_tile_above_pixels} decoded pixels")
        return (f"plan: mode {self.mode} dp={self.dp} sp={self.sp} device={self.device} budget {budget} per rank; "
                f"resident blocks {kept}; {vae} (--vae-tiling {self.vae_tiling})")

    def tiles(self, decoded_pixels: int) -> bool:
        """Whether a decode of `decoded_pixels` (width x height x frames x images) is tiled."""
        return decoded_pixels > self.vae_tile_above_pixels


@dataclass
class _Steps:
    """What the steps of `plan` have decided so far."""

    memory: PipelineMemory | None
    budget: int | None = None
    tile: int = VAE_TILE_ABOVE_PIXELS
    tiling: str = "the fixed rule: no pipeline memory"
    mode: Mode = "rank-local"
    why: str = ""
    resident: ResidentPlan | None = None
    merge_cache: int | None = None
    merge_above: int | None = None
    reasons: list[str] = field(default_factory=list)
    decision: Decision | None = None
    policy_error: str | None = None


def plan(ask: PlanAsk, *, profile: NodeProfile, transformer: ModelFacts, pipeline: PipelineMemory | None = None,
         limits: Limits | None = None, device_memory: int | None = None) -> DeploymentPlan:
    """The deployment plan for `ask` on a node of `profile` (the policy's view) whose device has
    `device_memory` bytes (None: the profile's accelerator), for the streamed `transformer` and, where
    known, the whole `pipeline` at `limits`. `DeviceBudgetError`: a given mode, or every mode, does
    not fit the budget (the message names the budget that would)."""
    if pipeline is not None and ask.lora.adapter_bytes:
        pipeline = dataclasses.replace(pipeline, whole={**pipeline.whole, LORA_COMPONENT: ask.lora.adapter_bytes})
    if pipeline is not None and ask.measured:
        pipeline = dataclasses.replace(pipeline, measured={**pipeline.measured, **ask.measured})
    s = _Steps(memory=pipeline)
    memory_bytes = device_memory if device_memory is not None else profile.accelerator.memory_bytes
    _budget_and_tiling(ask, s, memory_bytes, profile.accelerator.budget_bytes)
    _mode(ask, s, profile, transformer)
    _resident(ask, s)
    _merge_cache(ask, s)
    g = ask.world if s.mode == "allgather" else 1
    kept = _kept(ask, s)
    rank = s.memory.rank(s.mode, g, kept) if s.memory is not None else None
    return DeploymentPlan(
        mode=s.mode, mode_reason=s.why, dp=ask.dp, sp=ask.sp, device=ask.device, budget_bytes=s.budget,
        vae_tile_above_pixels=s.tile, tiling_reason=s.tiling, vae_tiling=ask.vae_tiling, resident=s.resident,
        resident_blocks=kept, limits=limits, lora_merge_cache_bytes=s.merge_cache,
        lora_merge_above_tokens=s.merge_above,
        weights_bytes=rank.weights_bytes if rank is not None else None,
        peaks=s.memory.phase_peaks(s.mode, g, kept) if s.memory is not None else {},
        needs=phase_needs(s.memory) if s.memory is not None else (),
        reasons=tuple(s.reasons), decision=s.decision,
        policy_error=s.policy_error)


def _budget_and_tiling(ask: PlanAsk, s: _Steps, device_memory: int, node_cap: int | None) -> None:
    """The device budget per rank (cuda and npu; cpu ranks have none: `--max-device-memory`, else the
    node profile's budget, caps it) and the decode rule it implies."""
    caps = [c for c in (ask.max_device_memory, node_cap) if c]
    cap = min(caps) if caps else 0
    if ask.device not in ("cuda", "npu"):
        s.tile, s.tiling = (0, "--vae-tiling always") if ask.vae_tiling == "always" else \
            (VAE_TILE_ABOVE_PIXELS, "no device budget on cpu: the fixed rule")
    elif s.memory is not None:
        s.budget = local_budget(device_memory, cap, s.memory)
        s.tile, s.tiling = tiling_for_budget(s.memory, s.budget, ask.vae_tiling)
        s.memory = dataclasses.replace(s.memory, tile_above_pixels=s.tile)
    else:
        s.budget = min(device_memory, cap) if cap else device_memory
    if s.budget is not None:
        s.reasons.append(f"device budget {format_gb(s.budget)} per rank"
                         + (f" (--max-device-memory {format_gb(ask.max_device_memory)})" if ask.max_device_memory
                            else " (the device's memory less what lives outside the allocator)"))
    s.reasons.append(f"vae: {s.tiling}" if s.tile >= NO_TILING else
                     f"vae tiling above {s.tile} decoded pixels: {s.tiling}")


def _mode(ask: PlanAsk, s: _Steps, profile: NodeProfile, transformer: ModelFacts) -> None:
    """The mode: as given (checked against the budget), else the policy's, else the fixed rule."""
    from dlo.plan.policy import NoModeFits, PolicyError, choose_mode

    if ask.mode != "auto":
        s.mode, s.why = ask.mode, "--mode given"
        if s.memory is not None and s.budget is not None:  # check_mode says where a guess alone says no
            s.reasons.append(check_mode(ask.mode, s.memory, s.budget, ask.world, ask.resident_blocks))
    else:
        trusted = s.memory.trusted() if s.memory is not None else None  # a guess never refuses a mode
        if s.memory is not None and s.budget is not None and (full := s.memory.rank("rank-local")).extrapolated:
            s.reasons.append(f"warning: the largest request's peak is extrapolated beyond the measured shapes "
                             f"({full.describe()}); planned with the measured figures")
        w = ask.workload
        try:
            decision = choose_mode(profile, transformer, ask.dp, sp=ask.sp, tokens_per_rank=w.tokens_per_rank,
                                   host_headroom_bytes=w.host_headroom_bytes,
                                   block_compute_seconds=w.block_compute_seconds,
                                   require_bandwidth=w.require_bandwidth,
                                   device_budget_bytes=ask.max_device_memory or None, pipeline=trusted)
            s.mode, s.why = decision.engine_mode, f"policy: {decision.reason}"
            s.decision = decision
        except NoModeFits as e:
            raise DeviceBudgetError(f"--mode auto: {e}", estimates=e.estimates) from None
        except (PolicyError, ValueError) as e:
            log.warning("mode policy gave no answer (%s); using the fixed rule", e)
            s.mode, s.why = ("allgather", "fixed rule: dp x sp > 1") if ask.world > 1 else \
                ("rank-local", "fixed rule: dp = 1")
            s.policy_error = str(e)
    s.reasons.append(f"mode {s.mode}: {s.why}")


def _resident(ask: PlanAsk, s: _Steps) -> None:
    """`--resident-blocks auto` in an offloaded mode under a budget: the blocks that fill it."""
    if ask.resident_blocks == "auto" and s.mode != "resident" and s.budget is not None and s.memory is not None:
        g = ask.world if s.mode == "allgather" else 1
        s.resident, line = resident_plan(s.memory, s.mode, g, s.budget)
        s.reasons.append(line)


def _kept(ask: PlanAsk, s: _Steps) -> dict[str, int]:
    """Blocks kept on the device per streamed model (none in resident mode: every block is)."""
    if s.resident is not None:
        return dict(s.resident.blocks)
    if s.memory is None or s.mode == "resident" or not isinstance(ask.resident_blocks, int):
        return {}
    return {name: min(ask.resident_blocks, m.blocks) for name, m in s.memory.transformers.items()}


def _merge_cache(ask: PlanAsk, s: _Steps) -> None:
    if ask.lora.merge_cache != "auto" or not ask.lora.served:
        return
    g = ask.world if s.mode == "allgather" else 1
    s.merge_cache, s.merge_above, line = auto_merge_cache(ask.lora, s.memory, s.mode, g, s.budget, _kept(ask, s),
                                                          s.resident)
    s.reasons.append(line)


def auto_merge_cache(lora: LoraAsk, memory: PipelineMemory | None, mode: Mode, g: int, budget: int | None,
                     kept: Mapping[str, int], resident: ResidentPlan | None) -> tuple[int, int | None, str]:
    """`--lora-merge-cache auto` sized: (bytes, merge-above tokens or None as given, why): what the
    budget has spare after the mode's predicted peak (with its resident blocks) and margin, up to
    every adapter's merges; on cpu (no budget) none. With a budget auto merges every request,
    whatever the cache got (the same numbers in every mode, whose spares differ)."""
    if budget is None or lora.apply == "branch" or memory is None:
        why = "no device budget (cpu)" if budget is None else (
            "--lora-apply branch merges nothing" if lora.apply == "branch" else "no pipeline memory")
        return 0, None, f"lora merge cache auto: none ({why})"
    spare = resident.spare_bytes if resident is not None else spare_bytes(memory, mode, g, dict(kept), budget)
    size = min(spare, lora.merges_bytes)
    above = 0 if lora.merge_above_tokens is None else lora.merge_above_tokens
    return size, above, (
        f"lora merge cache auto: {format_gb(size)} per rank for resident layers' merges (the budget's spare "
        f"after the mode's predicted peak and margin {format_gb(spare)}, every adapter's merges "
        f"{format_gb(lora.merges_bytes)}); auto merges requests of more than {above} tokens a call")


def device_of(profile: NodeProfile) -> DeviceKind:
    """The device kind a node's accelerators are (cpu: none, so no device budget)."""
    if not profile.accelerator.memory_bytes:
        return "cpu"
    return "npu" if profile.accelerator.vendor == "ascend" else "cuda"


def plan_folder(model_dir: Path, ask: PlanAsk, *, profile: NodeProfile, limits: Limits,
                device_memory: int | None = None, derive_limits: bool = False,
                measure: Callable[[PipelineMemory, list], Mapping[Any, int]] | None = None) -> DeploymentPlan:
    """`plan` for a diffusers pipeline folder at `limits`: its transformer's facts and the pipeline's
    memory read from the checkpoint headers and configs (torch-free) first. Where the limits do not
    fit the budget: with `derive_limits` (none were given) the first lower limits that fit
    (`dlo.plan.limits_fit`), else `DeviceBudgetError` naming up to three limit sets that would. With
    no limits given on an accelerator under mode auto, the largest limits that keep every weight on
    the device come first (`_resident_limits`). `measure` (a start on the device): called with each
    limit set's pipeline memory (and its default requests' shapes) before it is weighed, returns the peaks
    measured on the device."""
    from dlo.engine.families import pipeline_facts
    from dlo.plan.budget import request_bounds
    from dlo.plan.derive import default_shapes, derive
    from dlo.plan.folder import describe
    from dlo.plan.limits_fit import describe as limits_text
    from dlo.plan.limits_fit import first_fitting

    transformer = describe(model_dir / "transformer", ask.stream_dtype)
    facts, seen = pipeline_facts(model_dir), dict(ask.measured)
    given = deployment_memory(model_dir, limits, stream_encoders=ask.stream_encoders, stream_dtype=ask.stream_dtype,
                              cfg_pairs=ask.pairs_counted)  # read once: each candidate is these bounds changed
    geometry = given.geometry

    def at(candidate: Limits) -> DeploymentPlan:
        memory = given.with_bounds(request_bounds(candidate))
        if measure is not None:  # the candidate's shapes, and its default requests', measured on the device first
            seen.update(measure(memory, [(part, s) for s in default_shapes(facts, candidate)
                                         for part in ("vae_decode", "transformer")]))
        return plan(dataclasses.replace(ask, measured=dict(seen)), profile=profile, transformer=transformer,
                    pipeline=memory, limits=candidate, device_memory=device_memory)

    if derive_limits:
        room = min((c for c in (ask.max_device_memory, device_memory, profile.accelerator.memory_bytes) if c),
                   default=0)
        resident = (ask.mode == "auto" and ask.device in ("cuda", "npu")
                    and given.rank("resident").weights_bytes < room)  # the weights alone fit the device
        return derive(at, limits, geometry, lambda c: default_shapes(facts, c), resident)
    try:
        return at(limits)
    except DeviceBudgetError as e:
        fits = first_fitting(at, limits, geometry, DeviceBudgetError, count=3)
        sets = "; ".join(limits_text(f, geometry) for f, _ in fits)
        raise DeviceBudgetError(f"{e}" + (f"; limits that fit this budget: {sets}" if sets else ""),
                                estimates=e.estimates) from None

