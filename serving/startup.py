"""What rank 0's start is made of, apart from the ranks: the warm-up request, the start-up phases,
and the warnings about start costs that are the installation's, not the engine's.

Owns: `warmup_generation` (the one request every rank runs before `/ready`) and `WarmUp` (a
deployment's: its steps decided once), `startup_phases` (the `startup_seconds` of `/ready` and the
ready log) and `warn_about_start_costs`.
Must never: touch the ranks (the service runs the warm-up through its rank group), or import torch.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from dlo.engine.families import PipelineFacts
from dlo.engine.families.pipelines import WARMUP_STEPS
from dlo.engine.layout import align_up
from dlo.engine.request import Generation
from dlo.engine.timing import process_age_seconds, uncached_bytecode, unneeded_imports

log = logging.getLogger(__name__)


def warmup_generation(facts: PipelineFacts, sp: int, size: tuple[int, int] | None,
                      steps: int = WARMUP_STEPS) -> Generation:
    """One small request (`--warmup-steps` at `--warmup-size`, else the smallest valid size), run once by every
    rank before `/ready` turns 200: it goes through every path a request uses (text encoder,
    transformer with its gathers and transfer graphs, every CFG branch, scheduler, VAE decode,
    encoding), so library initialisation and first-call costs are paid before the first client."""
    least = facts.smallest_side
    row = facts.size_multiple * sp  # sp > 1: a width of sp tokens per row splits every frame's tokens over the sp ranks
    w, h = size or (align_up(least, row), least)
    return dataclasses.replace(facts.warmup(w, h, steps), warmup=True)  # an image, or a video-only family's shortest video


class WarmUp:
    """A deployment's warm-up (`--warmup`, `--warmup-size`, `--warmup-steps`): the request every rank
    runs, whose steps are decided once, at the warm-up (after the load: the family may read the
    scheduler to reach every transformer); what `/ready` says of it (None without warm-up)."""

    def __init__(self, facts: PipelineFacts, sp: int, model_dir: Path, enabled: bool,
                 size: tuple[int, int] | None, steps: int = WARMUP_STEPS):
        self.facts, self.sp, self.model_dir, self.enabled, self.size = facts, sp, model_dir, enabled, size
        self.asked_steps = steps
        self._steps: int | None = None

    def generation(self) -> Generation:
        if self._steps is None:
            self._steps = self.facts.warmup_steps(self.model_dir, self.asked_steps)
        return warmup_generation(self.facts, self.sp, self.size, self._steps)

    @property
    def size_text(self) -> str | None:
        """`WxH` of the warm-up generation."""
        if not self.enabled:
            return None
        g = warmup_generation(self.facts, self.sp, self.size)  # its size does not depend on the steps
        return f"{g.width}x{g.height}"

    @property
    def steps(self) -> int | None:
        """The warm-up's steps as run."""
        return self.generation().steps if self.enabled else None


def startup_phases(before_load: float, load_s: float, warmup_s: float | None, load_phases: dict[str, float],
                   warmup_phases: dict[str, float], before_load_phases: dict[str, float]) -> dict[str, Any]:
    """Where the time from process start to ready went: `before_load_phases`, `dlo serve`'s steps
    before the load (they add up to `before_load`), and `phases`: rank 0's in order, its load's steps
    then the warm-up request's `warmup_*` (every rank's own load phases are in `/ready`)."""
    return {"before_load": round(before_load, 2), "load": round(load_s, 2), "warmup": round(warmup_s or 0.0, 2),
            "total": round(process_age_seconds(), 2), "phases": {**load_phases, **warmup_phases},
            "before_load_phases": before_load_phases}


def warn_about_start_costs() -> None:
    """Once at ready: what made this start slower than it had to be, and what to do about it."""
    uncached = uncached_bytecode()
    if uncached:
        log.warning("%s imported from source: no cached bytecode and none written (PYTHONDONTWRITEBYTECODE=1 or "
                    "an install without .pyc files), so every start compiles them again (measured: 15-16 s of "
                    "imports instead of ~8 s for Wan2.1 on an H200 host); compile them at install "
                    "(pip's default, or python -m compileall on site-packages)", ", ".join(uncached))
    unneeded = unneeded_imports()
    if unneeded:
        log.warning("%s imported only because installed (diffusers and transformers import them when present; "
                    "the served families do not need them): ~2 s of every start measured for Wan2.1 on an H200 "
                    "host; the engine image leaves them out", ", ".join(unneeded))
