"""The shared vocabulary of every part: offload mode names and the facts of a model.

Owns: the one definition of the mode names (the CLI and CRD spelling `rank-local`, the JSON key
spelling `rank_local` of docs/contracts.md section 7, and the map between them) and `ModelFacts`, what
the policy, the agent, the operator and the engine know of a model without loading a weight.
Must never: import torch, diffusers or anything that does I/O (the agent and the operator import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The engine's and the command line's spelling (`dlo serve --mode`, `spec.mode`, `dlo.engine.load`).
Mode = Literal["allgather", "rank-local", "resident"]
MODES: tuple[Mode, ...] = get_args(Mode)
# `auto` is resolved by the policy before anything runs; it is never a running mode.
ModeOrAuto = Literal["auto", "allgather", "rank-local", "resident"]
MODES_OR_AUTO: tuple[ModeOrAuto, ...] = get_args(ModeOrAuto)

# What a node's accelerators are and how they are linked (the agent's NodeProfile, the engine's
# device facts): one definition for both.
Vendor = Literal["nvidia", "ascend", "none"]
InterconnectKind = Literal["nvlink", "hccs", "pcie", "none"]
# A device kind the engine runs on (`--device`, with `auto` resolved).
DeviceKind = Literal["cpu", "cuda", "npu"]

# The spelling used as JSON keys (`dlo plan --json`, `Decision.mode`): identifiers, no dash.
ModeKey = Literal["allgather", "rank_local", "resident"]
MODE_KEYS: tuple[ModeKey, ...] = get_args(ModeKey)


def key_of_mode(mode: Mode) -> ModeKey:
    """`rank-local` -> `rank_local` (a mode as a JSON key)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    return mode.replace("-", "_")  # type: ignore[return-value]


def mode_of_key(key: ModeKey) -> Mode:
    """`rank_local` -> `rank-local` (the engine's spelling of a JSON key)."""
    if key not in MODE_KEYS:
        raise ValueError(f"mode key must be one of {', '.join(MODE_KEYS)}; got {key!r}")
    return key.replace("_", "-")  # type: ignore[return-value]


@dataclass(frozen=True)
class ModelFacts:
    """What the policy needs to know of a transformer, read without loading a weight.

    `bytes` are the safetensors bytes of the transformer; `largest_block_bytes` the largest block
    in the slot layout (docs/contracts.md section 4); `nonblock_bytes` what stays resident on the device.
    With FP8 streaming (`dlo.engine.fp8`) the slot layout is the FP8 one, and three more facts say
    what the device holds in the compute dtype: `dequant_bytes` (the buffer one block's weights are
    dequantized into), `compute_block_bytes` (a resident block) and `compute_bytes` (all of it
    resident); 0 means as streamed (no FP8).
    """

    bytes: int
    largest_block_bytes: int
    blocks: int = 1
    nonblock_bytes: int = 0
    family: str = ""
    dequant_bytes: int = 0
    compute_block_bytes: int = 0
    compute_bytes: int = 0
