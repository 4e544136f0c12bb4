"""What the device budget decides for each rank before it loads: the VAE's fixed tiling rule and
`--resident-blocks auto`'s plan.

Owns: `VAE_TILE_ABOVE_PIXELS` (the fixed rule's threshold: cpu ranks, families the table lacks),
`NO_TILING` (every decode plain) and `ResidentPlan` (made by
`dlo.plan.memory_plan.resident_plan`, carried to every rank inside `dlo.engine.settings.EngineSettings`).
Must never: import anything of dlo but `dlo.plan.errors` (the engine's settings import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, get_args

from dlo.plan.errors import ConfigError, whole

# Decoded pixels (width x height x frames x images) above which the VAE decodes in tiles, unless the
# device budget decides otherwise (dlo.plan.memory_plan.tiling_for_budget): 1280x720 x 81 frames.
VAE_TILE_ABOVE_PIXELS = 1280 * 720 * 81
# No decode tiled: the plain decode of every accepted request fits the budget (the bytes of plain diffusers).
NO_TILING = 2**62
# `--vae-tiling`: auto (only where the plain decode cannot fit), always (every decode), never (a
# request auto would tile is refused)
VaeTiling = Literal["auto", "always", "never"]
VAE_TILINGS: tuple[VaeTiling, ...] = get_args(VaeTiling)


@dataclass(frozen=True)
class ResidentPlan:
    """`--resident-blocks auto` as `dlo serve` resolved it for the deployment's budget and limits
    (`dlo.plan.memory_plan.resident_plan`); each rank applies it at load (`within` its own room)."""

    blocks: Mapping[str, int]  # per streamed model: blocks kept on the device at the budget
    block_bytes: Mapping[str, int]  # per model: what one more resident block places
    budget_bytes: int  # the budget the plan was made for
    spare_bytes: int  # the budget less the predicted peak with these blocks and the margin
    encoders: tuple[str, ...] = ()  # the streamed text encoders among them (their blocks go first)

    def __post_init__(self) -> None:
        for name, n in {**self.blocks, **self.block_bytes}.items():
            whole(f"resident plan {name}", n, 0)
        if set(self.blocks) != set(self.block_bytes):
            raise ConfigError("a resident plan needs block bytes for every model it keeps blocks of")
        whole("resident plan budget_bytes", self.budget_bytes, 1)
        whole("resident plan spare_bytes", self.spare_bytes, 0)
        object.__setattr__(self, "encoders", tuple(self.encoders))
