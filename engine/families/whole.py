"""Components a pipeline family builds itself, whole (not streamed), without the accelerate package.

Owns: `load_whole` (a diffusers model folder built on the meta device, its safetensors assigned as
stored: the page-cache mappings safetensors hands out, no private copy and no random init; the
caller moves it to the device). diffusers' own `from_pretrained` refuses every class that keeps
modules in float32 (`_keep_in_fp32_modules`: MiniMax-H3's video and audio VAEs) unless accelerate
is installed; the engine does not install accelerate (its import is start-up time, and every
weight the engine loads is built this way or by `dlo.engine.load`).
Must never: import torch, diffusers or safetensors at import time (the families package is
torch-free), or cast: the stored dtypes are the ones the module runs in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_whole(folder: Path | str, cls: Any = None) -> Any:
    """The diffusers model of `folder` (config.json + safetensors files), in eval mode, on the host;
    `cls` defaults to the config's `_class_name`."""
    import diffusers
    from safetensors.torch import load_file

    from dlo.engine.checkpoint import read_json_config
    from dlo.engine.meta import parameters_on_meta

    folder = Path(folder)
    config = read_json_config(folder / "config.json")
    cls = cls or getattr(diffusers, config["_class_name"])
    with parameters_on_meta():  # buffers a constructor computes stay real
        model = cls.from_config(config)
    state: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
