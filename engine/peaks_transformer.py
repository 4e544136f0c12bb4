"""A transformer call's device peak, measured on the device that serves: one block of the pipeline's
own transformer class (its config with one block of each kind, random weights in the compute dtype)
called at each shape as the family's pipeline calls it. Blocks run one after another and each one's
intermediates are freed before the next, so the reserved growth over the weights of one block's call
is the call's need at any number of blocks: what `dlo.plan` adds to the weights a mode places
(`placed_weight_bytes`), measured instead of the table's extrapolation.

Owns: `transformer_inputs` (the keyword arguments a family's pipeline passes its transformer for
one call: shared with the table's calibration, bench/memory_probe.py), `one_block_transformer` and
`transformer_call`.
Must never: load the checkpoint's weights (random ones weigh the same).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from dlo.plan.memory_model import Shape

log = logging.getLogger(__name__)

SEED = 0
BLOCK_COUNTS = ("num_layers", "num_single_layers")  # the config keys that count blocks (Flux has both)
MEASURED_FAMILIES = ("wan", "wan2.2", "wan-i2v", "flux", "qwen-image")  # those `transformer_inputs` knows


def transformer_inputs(family: str, cfg: dict, shape: Shape, text_len: int, image_tokens: int, dtype: Any,
                       device: Any) -> dict[str, Any]:
    """The keyword arguments the family's pipeline passes its transformer for one call at `shape`
    (unconditional and conditional calls are separate calls in these pipelines: one batch of
    `shape.batch`)."""
    import torch

    b, h, w = shape.batch, shape.height, shape.width
    gen = torch.Generator(device).manual_seed(SEED)

    def rnd(*size: int) -> Any:
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    if family.startswith("wan"):
        frames = (shape.frames - 1) // 4 + 1
        out = {"hidden_states": rnd(b, cfg["in_channels"], frames, h // 8, w // 8),
               "timestep": torch.full((b,), 500, device=device, dtype=torch.long),
               "encoder_hidden_states": rnd(b, text_len, cfg["text_dim"])}
        if cfg.get("image_dim"):
            out["encoder_hidden_states_image"] = rnd(b, image_tokens, cfg["image_dim"])
        return out
    tokens = (h // 16) * (w // 16)
    common = {"hidden_states": rnd(b, tokens, cfg["in_channels"]),
              "timestep": torch.full((b,), 0.5, device=device, dtype=dtype)}
    if family == "flux":
        return {**common, "encoder_hidden_states": rnd(b, text_len, cfg["joint_attention_dim"]),
                "pooled_projections": rnd(b, cfg["pooled_projection_dim"]),
                "guidance": torch.full((b,), 3.5, device=device, dtype=dtype) if cfg.get("guidance_embeds") else None,
                "img_ids": torch.zeros(tokens, 3, device=device, dtype=dtype),
                "txt_ids": torch.zeros(text_len, 3, device=device, dtype=dtype)}
    if family == "qwen-image":  # batch 1 prompts are unpadded: the pipeline passes no mask
        return {**common, "encoder_hidden_states": rnd(b, text_len, cfg["joint_attention_dim"]),
                "encoder_hidden_states_mask": None, "img_shapes": [[(1, h // 16, w // 16)]] * b}
    raise ValueError(f"no transformer inputs for family {family!r}")


def image_tokens(model_dir: Path) -> int:
    """The image encoder's tokens an image-to-video call carries (0 without one)."""
    from dlo.engine.checkpoint import read_json_config

    path = model_dir / "image_encoder" / "config.json"
    if not path.is_file():
        return 0
    cfg = read_json_config(path)
    vision = cfg.get("vision_config", cfg)
    return (int(vision["image_size"]) // int(vision["patch_size"])) ** 2 + 1


def one_block_transformer(model_dir: Path, class_name: str, device: Any, dtype: Any) -> Any:
    """The folder's transformer class from its config with one block of each kind, random weights,
    on `device` in `dtype`."""
    import diffusers
    import torch

    from dlo.engine.checkpoint import read_json_config

    cfg = {k: v for k, v in read_json_config(model_dir / "transformer" / "config.json").items()
           if not k.startswith("_")}
    cfg.update({k: 1 for k in BLOCK_COUNTS if k in cfg})
    with torch.device(device):
        module = getattr(diffusers, class_name).from_config(cfg)
    return module.to(dtype).eval()


def transformer_call(model_dir: Path, facts: Any, text_len: int, device: Any) -> Callable[[Shape], Any] | None:
    """A function that makes one call of one block of the pipeline's transformer at a shape (its
    inputs made inside it: their bytes are the call's too); None for a family it cannot call. The
    module lives as long as the function."""
    import torch

    if facts.family not in MEASURED_FAMILIES:
        return None
    dtype = torch.bfloat16
    module = one_block_transformer(model_dir, facts.transformer_class, device, dtype)
    cfg, tokens = dict(module.config), image_tokens(model_dir)

    def call(shape: Shape) -> Any:
        kwargs = transformer_inputs(facts.family, cfg, shape, text_len, tokens, dtype, device)
        return module(**kwargs, return_dict=False)[0]

    return call
