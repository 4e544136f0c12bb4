"""Build a diffusers model without materialising its weights, and decide each tensor's dtype.

Owns: constructing the model named in `config.json` with every *parameter* on the `meta` device
while buffers are computed for real (`dlo.engine.meta.parameters_on_meta`: so non-persistent
buffers such as Wan's `rope.freqs_cos/sin`, which are not in the checkpoint, come out right
instead of staying on `meta`), the dtype policy
(the checkpoint's compute dtype, float32 for the class's `_keep_in_fp32_modules`), and the map from
checkpoint names to the module slots that hold them.
Must never: allocate or initialise a parameter's data (a 14B model is built in seconds, in no memory).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dlo.engine.checkpoint import FLOAT_DTYPES, Checkpoint, CheckpointError
from dlo.engine.dtypes import safetensors_name
from dlo.engine.blocks import BlockKeys, group_keys
from dlo.engine.families import BlockFamily, family_of, read_config
from dlo.engine.meta import parameters_on_meta


@dataclass
class MetaModel:
    module: nn.Module
    config: dict
    family: BlockFamily
    blocks: list[BlockKeys]  # execution order
    nonblock: list[str]
    target_dtype: dict[str, str]  # checkpoint name -> safetensors dtype the model computes it in
    compute_dtype: str
    aliases: dict[str, str] = field(default_factory=dict)  # tied tensor name -> the stored name it shares

    def block_module(self, block: BlockKeys) -> nn.Module:
        return self.module.get_submodule(block.list_name)[block.index]


def build_meta_model(component_dir: Path | str, ckpt: Checkpoint) -> MetaModel:
    """Build the model on meta, validate the checkpoint against it, and group its blocks."""
    import diffusers

    config = read_config(component_dir)
    class_name = config["_class_name"]
    family = family_of(class_name)
    transformers_model = config.get("_library") == "transformers"
    if transformers_model:
        import transformers

        cls = getattr(transformers, class_name, None)
        library = "transformers"
    else:
        cls = getattr(diffusers, class_name, None)
        library = "diffusers"
    if cls is None:
        raise CheckpointError(Path(component_dir) / "config.json", f"{library} has no class {class_name!r}")
    with parameters_on_meta():
        if transformers_model:
            fields = {k: v for k, v in config.items() if not k.startswith("_")}
            module = cls(cls.config_class.from_dict(fields))
        else:
            module = cls.from_config(config)
    module.eval().requires_grad_(False)

    # Tied tensors (T5's shared embedding is also encoder.embed_tokens) are stored once, under
    # their first name; the others are aliases bound to the same tensor after load.
    expected: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first_name:
            aliases[name] = first_name[id(t)]
            continue
        first_name[id(t)] = name
        expected[name] = t
    compute = _compute_dtype(ckpt, expected)
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or [])
    if transformers_model and compute != "F16":
        keep = set()  # transformers keeps these modules in fp32 only for float16 (as from_pretrained does)
    allowed: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    target: dict[str, str] = {}
    for name, t in expected.items():
        native = safetensors_name(t.dtype)
        if native not in FLOAT_DTYPES:
            allowed[name] = (tuple(t.shape), (native,))
            target[name] = native
        elif keep.intersection(name.split(".")):
            # Stored in fp32, or in the compute dtype and upcast on load (as diffusers does).
            allowed[name] = (tuple(t.shape), ("F32", compute))
            target[name] = "F32"
        else:
            allowed[name] = (tuple(t.shape), (compute,))
            target[name] = compute
    _allow_stored_fp8(ckpt, allowed)
    ckpt.validate(allowed)
    blocks, nonblock = group_keys(set(expected), family)
    _check_blocks_match_lists(module, family, blocks)
    return MetaModel(module, config, family, blocks, nonblock, target, compute, aliases)


def _allow_stored_fp8(ckpt: Checkpoint, allowed: dict[str, tuple[tuple[int, ...], tuple[str, ...]]]) -> None:
    """A folder `dlo quantize` wrote: its FP8 weights (computed in their usual dtype once dequantized,
    `dlo.engine.fp8`) and, beside each, its float32 scale of one value per output row."""
    from dlo.engine.fp8 import FP8, SCALE_DTYPE, stored_weights

    for weight, scale in stored_weights(ckpt).items():
        if weight in allowed:
            shape = allowed[weight][0]
            allowed[weight] = (shape, (FP8,))
            allowed[scale] = ((shape[0],), (SCALE_DTYPE,))


def _compute_dtype(ckpt: Checkpoint, expected: dict[str, torch.Tensor]) -> str:
    """The floating dtype holding most of the checkpoint's bytes."""
    by_bytes: Counter[str] = Counter()
    for name, info in ckpt.tensors.items():
        # an FP8 weight (`dlo quantize`) computes in the dtype of the rest: its own dtype never decides
        if info.dtype in FLOAT_DTYPES and name in expected and info.dtype != "F8_E4M3":
            by_bytes[info.dtype] += info.nbytes
    if not by_bytes:
        raise CheckpointError(ckpt.root, "no floating-point tensor of the model in the checkpoint")
    return by_bytes.most_common(1)[0][0]


def _check_blocks_match_lists(module: nn.Module, family: BlockFamily, blocks: list[BlockKeys]) -> None:
    n = sum(len(module.get_submodule(name)) for name in family.block_lists)
    if n != len(blocks):
        raise CheckpointError(
            family.name, f"the model has {n} blocks in {family.block_lists} but {len(blocks)} hold weights"
        )


def owner_of(root: nn.Module, name: str) -> tuple[nn.Module, str, bool]:
    """The module holding tensor `name`, its attribute, and whether it is a parameter."""
    prefix, _, attr = name.rpartition(".")
    owner = root.get_submodule(prefix) if prefix else root
    if attr in owner._parameters:
        return owner, attr, True
    if attr in owner._buffers:
        return owner, attr, False
    raise KeyError(f"{name!r} is neither a parameter nor a buffer of the model")


def set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, attr, is_param = owner_of(root, name)
    if is_param:
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


def move_free_buffers(module: nn.Module, device: torch.device, stored: set[str]) -> int:
    """Move buffers that are not in the checkpoint (non-persistent: RoPE tables) to the device."""
    moved = 0
    for mod_name, mod in module.named_modules():
        for attr, buf in list(mod._buffers.items()):
            full = f"{mod_name}.{attr}" if mod_name else attr
            if buf is None or full in stored:
                continue
            if buf.device.type == "meta":
                raise CheckpointError(full, "buffer is on meta and not in the checkpoint: cannot recompute it")
            mod._buffers[attr] = buf.to(device)
            moved += buf.numel() * buf.element_size()
    return moved


def assert_nothing_on_meta(module: nn.Module, allow: set[str]) -> None:
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type == "meta" and name not in allow:
            raise RuntimeError(f"{name} is still on meta after load; this is a bug in the loader")
