"""Every adapter of a `--lora-dir` checked against the model before any rank starts.

Owns: `check_adapters` (what `dlo serve` runs at start: each adapter of the folder planned against
the pipeline's transformer, its values read once and checked (`dlo.engine.lora.limits`), the first
that does not fit refused with an `AdapterError` naming its file). A diffusers-format file is read as its header alone (`dlo.engine.lora.adapters`); any other
goes through the family's diffusers converter (`dlo.engine.lora.weights.read_adapter`, imported
only for such a file: it imports torch).
Must never: import torch at module import (`dlo serve` checks adapters before any rank starts), or
load an adapter's tensors into torch where its header alone decides (the value check streams them
through numpy a chunk at a time).
"""

from __future__ import annotations

from pathlib import Path

from dlo.engine.checkpoint import CheckpointError, cached_checkpoint, read_header
from dlo.engine.lora.limits import check_values
from dlo.engine.lora.adapters import (
    AdapterError,
    AdapterPlan,
    find_adapters,
    parse_metadata,
    passes_through,
    plan_adapter,
)


def check_adapters(lora_dir: Path | str, model_dir: Path | str, pipeline_class: str) -> list[AdapterPlan]:
    """Every adapter of `lora_dir` checked against the pipeline's transformer (`model_dir/transformer`);
    the first that does not fit raises `AdapterError` naming its file. Diffusers-format files are
    read as headers only; other formats through the family's diffusers converter (imports torch)."""
    try:
        weights = cached_checkpoint(Path(model_dir) / "transformer").tensors
    except CheckpointError as e:
        raise AdapterError(model_dir, f"cannot read the transformer to check adapters against: {e}") from None
    plans = []
    for entry in find_adapters(lora_dir):
        try:
            tensors, header_metadata = read_header(entry.path)
            check_values(entry.path, tensors)
        except CheckpointError as e:
            raise AdapterError(entry.path, f"not a readable safetensors file: {e}") from None
        except OSError as e:
            raise AdapterError(entry.path, f"cannot read: {e.strerror or e}") from None
        if passes_through(tensors):
            shapes = {k: t.shape for k, t in tensors.items()}
            dtypes = {k: t.dtype for k, t in tensors.items()}
            plans.append(plan_adapter(entry, shapes, dtypes, parse_metadata(entry.path, header_metadata), None,
                                      weights))
        else:
            from dlo.engine.lora.weights import read_adapter

            plans.append(read_adapter(entry, pipeline_class, weights).plan)
    return plans
