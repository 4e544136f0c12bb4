"""Where start-up time goes: the process's age and named laps of a load.

Owns: `process_age_seconds` (seconds since this process was created, for the ready log) and `Laps`
(consecutive named intervals, for the `phases=` of the rank-join and pipeline-load log lines).
"""

from __future__ import annotations

import time


def process_age_seconds() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


class Laps:
    """`lap(name)` records the seconds since the previous lap (or since construction) under `name`."""

    def __init__(self, start: float | None = None):
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter() if start is None else start

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name], self._mark = now - self._mark, now

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.phases.items()}
