"""The device budget of a deployment: what one rank may use of its device, and whether a mode fits it.

Owns: the deployment's memory (`deployment_memory`: the pipeline folder's facts at the limits it
serves, from `dlo.plan.memory_model`; `request_bounds`: what it reads of the limits), the budget of a device (`local_budget`: the smallest of its
memory and `--max-device-memory`), the check of a given mode against it (`check_mode`), and
`DeviceBudgetError`, which `dlo serve` prints in one line and exits 2 on, before anything loads.
`dlo.plan.deployment.plan` calls them in order.
Must never: allocate on a device, or refuse a mode on a guess: without a measured table a given
mode is refused only when its weights alone exceed the budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dlo.plan.errors import ConfigError

if TYPE_CHECKING:
    from dlo.plan.memory_model import PipelineMemory
    from dlo.plan.limits import Limits


LORA_COMPONENT = "lora_adapters"  # the adapters' bytes in the pipeline's memory, beside the VAE


class DeviceBudgetError(ConfigError):
    """No mode (or not the mode given) fits the device budget: the message names what does not fit
    and the smallest budget, or the largest `--max-size`, that would; `estimates`: the policy's per
    mode where it was asked."""

    def __init__(self, message: str, estimates: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.estimates = dict(estimates or {})


def deployment_memory(model_dir: Path, limits: Limits, *, stream_encoders: bool = True,
                      stream_dtype: str = "bfloat16", cfg_pairs: bool = False) -> PipelineMemory:
    """The pipeline's memory at `limits` (`dlo.plan.memory_model.pipeline_memory`; `cfg_pairs`: with
    the waiting lane where the family pairs); a memory table or a component header that does not
    parse is a `DeviceBudgetError` naming it."""
    from dlo.plan.memory_model import pipeline_memory
    from dlo.plan.memory_table import TableError
    from dlo.plan.resident import VAE_TILE_ABOVE_PIXELS

    try:
        return pipeline_memory(model_dir, request_bounds(limits), tile_above_pixels=VAE_TILE_ABOVE_PIXELS,
                               stream_encoders=stream_encoders, stream_dtype=stream_dtype, cfg_pairs=cfg_pairs)
    except TableError as e:
        raise DeviceBudgetError(str(e)) from None
    except ConfigError as e:  # an FP8 folder (dlo quantize) without --stream-dtype fp8
        raise DeviceBudgetError(str(e)) from None
    except (KeyError, ValueError) as e:  # a component's config or safetensors header (CheckpointError)
        raise DeviceBudgetError(f"{model_dir}: cannot read the pipeline's weights: {e}") from None


def request_bounds(limits: Limits) -> Any:
    """The `RequestBounds` of `limits`: what the memory model reads of them."""
    from dlo.plan.memory_model import RequestBounds

    return RequestBounds(limits.max_width, limits.max_height, limits.max_frames, limits.max_n,
                         limits.max_sequence_length)


def local_budget(device_memory: int, max_device_memory: int, memory: PipelineMemory) -> int:
    """What one rank may use of a device of `device_memory` bytes under an optional cap: the cap is
    the allocator's own; the device's memory loses what lives outside the allocator (measured)."""
    usable = device_memory - memory.context_bytes
    return min(usable, max_device_memory) if max_device_memory else usable


def check_mode(mode: str, memory: PipelineMemory, budget: int, g: int, resident_blocks: int | str = 0) -> str:
    """The one-line verdict of a given `--mode` against `budget`; `DeviceBudgetError` when it does
    not fit (its peak by measured figures over the budget, or without a measured table its weights
    alone); a peak over it only by an extrapolated figure is a warning."""
    from dlo.plan.policy import DEVICE_RESERVE_RATIO
    from dlo.plan.memory_model import format_gb as _gb
    from dlo.plan.limits_fit import largest_fitting_size

    kept = resident_blocks if isinstance(resident_blocks, int) else 0  # "auto" sizes itself at load
    g = g if mode == "allgather" else 1
    rank = memory.trusted().rank(mode, g, kept)  # a guess beyond the measured shapes never refuses
    peak = rank.peak_bytes
    if peak is not None and peak <= budget:
        full = memory.rank(mode, g, kept)
        if full.peak_bytes is not None and full.peak_bytes > budget:
            return (f"--mode {mode}: {full.describe()} may not fit the device budget of {_gb(budget)}: the largest "
                    "request's peak is extrapolated beyond the measured shapes (`dlo calibrate --peaks` measures it)")
        return f"--mode {mode} fits the device budget of {_gb(budget)}: {rank.describe()}"
    if peak is None and rank.weights_bytes <= budget:
        tight = rank.weights_bytes > budget * (1 - DEVICE_RESERVE_RATIO)
        return (f"--mode {mode}: {rank.describe()}; the device budget is {_gb(budget)}"
                + (" (less than 15% left for activations: a large request may run out of memory)" if tight else ""))
    need = peak if peak is not None else rank.weights_bytes
    advice = f"the smallest budget that fits --mode {mode} is {_gb(need)}"
    if peak is not None:
        side = largest_fitting_size(memory.trusted(), mode, g, budget)
        if side is not None:
            advice += f", or limits up to --max-size {side} at this budget"
    raise DeviceBudgetError(f"--mode {mode} does not fit the device budget of {_gb(budget)} per rank: needs "
                            f"{_gb(need)} ({rank.describe()}); {advice}")
