"""The peaks a start of `dlo serve` plans with, measured on its device (cuda) at every limit set the
plan weighs: the limits given, or, where it derives them, each candidate it tries.

Owns: `StartPeaks` (called by `dlo.plan.deployment.plan_folder` with a candidate's pipeline memory:
the peaks cached for this device, model and libraries, with what that candidate's shapes lack measured
now; one deadline for the whole start) and `start_measure` (one for a start, or None: not cuda, or
`--peaks-deadline 0`).
Must never: import torch itself (the calibration does, on cuda only), or stop a start: where a
measurement fails or the deadline has passed, the figures so far stand, and the log says so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class StartPeaks:
    """Every candidate's decodes and transformer calls (and `extra` shapes: its default requests')
    measured (`dlo.engine.calibrate.calibrate_peaks`) before the plan weighs it, within `deadline_s`
    seconds in all."""

    def __init__(self, model_dir: Path, deadline_s: float) -> None:
        self.model_dir, self.until = model_dir, time.monotonic() + deadline_s
        self.peaks: Any = None  # MeasuredPeaks, once read (`_cached`) or measured

    def __call__(self, memory: Any, extra: list | None = None) -> dict[Any, int]:
        from dlo.engine.calibrate import calibrate_peaks

        try:
            if self.peaks is None:
                self.peaks = self._cached()
            left = self.until - time.monotonic()
            if left > 0:
                self.peaks, _, lines = calibrate_peaks(self.model_dir, memory, left, old=self.peaks, extra=extra)
                for line in lines:
                    log.info("measured peak: %s", line)
        except Exception as e:  # noqa: BLE001 - said, not hidden: the figures so far stand
            log.warning("device peaks not measured: %s", e)
            self.until = 0.0
        return dict(self.peaks.points) if self.peaks is not None else {}

    def _cached(self) -> Any:
        """The peaks cached for this device, model and libraries, or none yet (empty): who they are of
        is read here once, not by each candidate's calibration."""
        from dlo.engine.peaks import device_name, library_versions
        from dlo.plan.measured import MeasuredPeaks, load_peaks, model_digest

        name, versions = device_name("cuda:0"), library_versions()
        return load_peaks(self.model_dir, name, versions) or MeasuredPeaks(name, versions, model_digest(self.model_dir))


def start_measure(cfg: Any, start: Any) -> StartPeaks | None:
    """The measurer of one start: on cuda with a `--peaks-deadline`, else None (the table's figures)."""
    if start.device == "cuda" and cfg.memory.peaks_deadline:
        return StartPeaks(start.model_dir, cfg.memory.peaks_deadline)
    return None
