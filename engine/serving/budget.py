"""The device budget of `dlo serve`: what one rank may use of its device, and whether the mode fits it.

Owns: the deployment's memory (`deployment_memory`: the pipeline folder's facts at the limits it
serves, from `dlo.engine.memory_model`; `deployment`: that, this host's device budget and the VAE
tiling rule the budget implies; `budget_inputs`, what `resolve_mode` gets of it), the budget of
this host's device (`local_budget`: the smallest of its memory and `--max-device-memory`), the check
of a `--mode` given on the command line against it (`check_mode`), what the budget decides in the
settings every rank starts with (`plan_settings`: the tiling rule and `--resident-blocks auto`'s
plan, `dlo.engine.memory_plan`), and `DeviceBudgetError`, which `dlo serve` prints in one line and
exits 2 on, before anything loads. `--mode auto` gets the same inputs through the policy
(`dlo.agent.policy.choose_mode(device_budget_bytes=..., pipeline=...)`).
Must never: allocate on a device, or refuse a mode on a guess: without a measured table a given
mode is refused only when its weights alone exceed the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo.engine.serving.options import cfg_pairs_asked
from dlo.engine.settings import ConfigError, EngineSettings

if TYPE_CHECKING:
    from dlo.engine.memory_model import PipelineMemory
    from dlo.engine.serving.limits import Limits


LORA_COMPONENT = "lora_adapters"  # the adapters' bytes in the pipeline's memory, beside the VAE


class DeviceBudgetError(ConfigError):
    """No mode (or not the mode given) fits the device budget: the message names what does not fit
    and the smallest budget, or the largest `--max-size`, that would."""


def deployment_memory(model_dir: Path, limits: Limits, *, stream_encoders: bool = True,
                      stream_dtype: str = "bfloat16", cfg_pairs: bool = False) -> PipelineMemory:
    """The pipeline's memory at `limits` (`dlo.engine.memory_model.pipeline_memory`; `cfg_pairs`: with
    the waiting lane where the family pairs); a memory table or a component header that does not
    parse is a `DeviceBudgetError` naming it."""
    from dlo.engine.memory_model import RequestBounds, pipeline_memory
    from dlo.engine.memory_table import TableError
    from dlo.engine.settings import VAE_TILE_ABOVE_PIXELS

    bounds = RequestBounds(limits.max_width, limits.max_height, limits.max_frames, limits.max_n,
                           limits.max_sequence_length)
    try:
        return pipeline_memory(model_dir, bounds, tile_above_pixels=VAE_TILE_ABOVE_PIXELS,
                               stream_encoders=stream_encoders, stream_dtype=stream_dtype, cfg_pairs=cfg_pairs)
    except TableError as e:
        raise DeviceBudgetError(str(e)) from None
    except ConfigError as e:  # an FP8 folder (dlo quantize) without --stream-dtype fp8
        raise DeviceBudgetError(str(e)) from None
    except (KeyError, ValueError) as e:  # a component's config or safetensors header (CheckpointError)
        raise DeviceBudgetError(f"{model_dir}: cannot read the pipeline's weights: {e}") from None


@dataclass(frozen=True)
class Deployment:
    """The pipeline's memory at its limits under this host's device budget."""

    memory: PipelineMemory  # with the tiling rule the budget implies
    budget: int | None  # bytes per rank; None: no accelerator (cpu ranks)
    tiling: str  # why that tiling rule


def deployment(args: Any, model_dir: Path, limits: Limits, device: str, adapter_bytes: int = 0) -> Deployment:
    """`deployment_memory` for `dlo serve`'s options (`--cfg-pairs` at sp 1: the waiting lane), with
    `--lora-dir`'s adapters as a whole component of every rank (`lora_adapters`: `adapter_bytes`,
    their tensors and any merge scratch), this host's budget (`local_budget`) and the tiling rule it
    implies (`dlo.engine.memory_plan.tiling_for_budget`)."""
    memory = deployment_memory(model_dir, limits, stream_encoders=args.stream_text_encoders,
                               stream_dtype=args.stream_dtype, cfg_pairs=cfg_pairs_asked(args))
    if adapter_bytes:
        memory = dataclasses.replace(memory, whole={**memory.whole, LORA_COMPONENT: adapter_bytes})
    if device not in ("cuda", "npu"):
        return Deployment(memory, None, "no device budget on cpu: the fixed rule")
    from dlo.engine.devices import device_facts
    from dlo.engine.memory_plan import tiling_for_budget

    budget = local_budget(device_facts(device).memory_bytes, args.max_device_memory, memory)
    tile, why = tiling_for_budget(memory, budget)
    return Deployment(dataclasses.replace(memory, tile_above_pixels=tile), budget, why)


def budget_inputs(args: Any, dep: Deployment) -> dict[str, Any]:
    """`resolve_mode`'s budget keywords from `dlo serve`'s options (`--max-device-memory`,
    `--resident-blocks`, `--stream-dtype`) and the deployment."""
    return {"max_device_memory": args.max_device_memory, "resident_blocks": args.resident_blocks,
            "memory": dep.memory, "stream_dtype": args.stream_dtype}


def plan_settings(settings: EngineSettings, dep: Deployment,
                  merges_bytes: int = 0) -> tuple[EngineSettings, list[str]]:
    """The settings every rank starts with, with what the budget decides: the VAE tiling rule, for
    `--resident-blocks auto` in an offloaded mode the plan of resident blocks, and an auto LoRA merge
    cache (`merges_bytes`: every adapter's merges, its cap); and the log lines that state the arithmetic."""
    from dlo.engine.memory_plan import resident_plan

    lines = [f"vae tiling above {dep.memory.tile_above_pixels} decoded pixels: {dep.tiling}"]
    plan = None
    g = settings.parallel.world if settings.mode == "allgather" else 1
    if settings.offload.resident_blocks == "auto" and settings.mode != "resident" and dep.budget is not None:
        plan, line = resident_plan(dep.memory, settings.mode, g, dep.budget)
        lines.append(line)
    settings = dataclasses.replace(settings, resident_plan=plan, vae_tile_above_pixels=dep.memory.tile_above_pixels)
    if settings.lora.merge_cache_bytes == "auto" and settings.lora.directory is not None:
        lora, line = _auto_merge_cache(settings, dep, g, merges_bytes)
        settings = dataclasses.replace(settings, lora=lora)
        lines.append(line)
    return settings, lines


def _auto_merge_cache(settings: EngineSettings, dep: Deployment, g: int, merges_bytes: int) -> tuple[Any, str]:
    """`--lora-merge-cache auto` sized: what the budget has spare after the mode's predicted peak (with
    its resident blocks) and margin, up to every adapter's merges; on cpu (no budget) none. With a
    budget auto merges every request, whatever the cache got (`LoraSettings.merge_above`: the same
    numbers in every mode, whose spares differ)."""
    from dlo.engine.memory_model import format_gb
    from dlo.engine.memory_plan import spare_bytes

    lora = settings.lora
    if dep.budget is None or lora.apply == "branch":
        why = "no device budget (cpu)" if dep.budget is None else "--lora-apply branch merges nothing"
        return dataclasses.replace(lora, merge_cache_bytes=0), f"lora merge cache auto: none ({why})"
    plan = settings.resident_plan
    if plan is not None:
        spare = plan.spare_bytes
    else:
        kept = settings.offload.resident_blocks if isinstance(settings.offload.resident_blocks, int) else 0
        spare = spare_bytes(dep.memory, settings.mode, g, kept, dep.budget)
    size = min(spare, merges_bytes)
    above = 0 if lora.merge_above_tokens is None else lora.merge_above_tokens
    line = (f"lora merge cache auto: {format_gb(size)} per rank for resident layers' merges (the budget's spare "
            f"after the mode's predicted peak and margin {format_gb(spare)}, every adapter's merges "
            f"{format_gb(merges_bytes)}); auto merges requests of more than {above} tokens a call")
    return dataclasses.replace(lora, merge_cache_bytes=size, merge_above_tokens=above), line


def local_budget(device_memory: int, max_device_memory: int, memory: PipelineMemory) -> int:
    """What one rank may use of a device of `device_memory` bytes under an optional cap: the cap is
    the allocator's own; the device's memory loses what lives outside the allocator (measured)."""
    usable = device_memory - memory.context_bytes
    return min(usable, max_device_memory) if max_device_memory else usable


def check_mode(mode: str, memory: PipelineMemory, budget: int, g: int, resident_blocks: int | str = 0) -> str:
    """The one-line verdict of a given `--mode` against `budget`; `DeviceBudgetError` when it does
    not fit (its predicted peak over the budget, or without a measured table its weights alone)."""
    from dlo.agent.policy import DEVICE_RESERVE_RATIO
    from dlo.engine.memory_model import format_gb as _gb
    from dlo.engine.memory_model import largest_fitting_size

    kept = resident_blocks if isinstance(resident_blocks, int) else 0  # "auto" sizes itself at load
    rank = memory.rank(mode, g if mode == "allgather" else 1, kept)
    peak = rank.peak_bytes
    if peak is not None and peak <= budget:
        return f"--mode {mode} fits the device budget of {_gb(budget)}: {rank.describe()}"
    if peak is None and rank.weights_bytes <= budget:
        tight = rank.weights_bytes > budget * (1 - DEVICE_RESERVE_RATIO)
        return (f"--mode {mode}: {rank.describe()}; the device budget is {_gb(budget)}"
                + (" (less than 15% left for activations: a large request may run out of memory)" if tight else ""))
    need = peak if peak is not None else rank.weights_bytes
    advice = f"the smallest budget that fits --mode {mode} is {_gb(need)}"
    if peak is not None:
        side = largest_fitting_size(memory, mode, g if mode == "allgather" else 1, budget)
        if side is not None:
            advice += f", or limits up to --max-size {side} at this budget"
    raise DeviceBudgetError(f"--mode {mode} does not fit the device budget of {_gb(budget)} per rank: needs "
                            f"{_gb(need)} ({rank.describe()}); {advice}")
