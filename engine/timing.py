"""Where start-up time goes: the process's age and named laps of a load.

Owns: `process_age_seconds` (seconds since this process was created, for the ready log), `Laps`
(consecutive named intervals, for the `phases=` of the rank-join, pipeline-load and model-load log
lines), `uncached_bytecode` (the imported packages compiled from source in this process: the
largest avoidable share of a start-up) and `unneeded_imports` (optional packages imported only
because they are installed), both for the ready log's warnings.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time

log = logging.getLogger(__name__)

# The packages whose imports dominate a start-up (a Wan2.1 server's imports on an H200 host: 15-16 s
# from source, ~8 s from bytecode; records `raw-import-profile-2026-11-30-bytecode`, `-no-bytecode`).
HEAVY_PACKAGES = ("torch", "diffusers", "transformers")


def process_age_seconds() -> float:
    """Seconds since this process started. On Linux: /proc/self/stat's start time against
    CLOCK_BOOTTIME, both counted from boot, to the clock tick (10 ms). psutil's `create_time` adds
    /proc/stat's boot time, a whole second, so its ages were up to a second off (a Wan2.1 server's
    `total` read 10.25 s where the client had seen /ready answer in ~9.6 s)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        start_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22; the list starts at field 3
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError) as e:  # not Linux
        log.debug("process age from psutil (up to a second long): %s", e)
        import psutil

        return time.time() - psutil.Process().create_time()


Interval = tuple[str, int, int]  # (name, start, end): wall-clock nanoseconds (time.time_ns)


class PhaseClock:
    """The phase a piece of work is in ("idle" between pieces) and the seconds spent in each phase
    since `reset()`: `enter(name)` adds the time of the phase it leaves. `timeline` holds each phase
    left and each mark ended (`start_mark`/`end_mark`: a part inside a phase, such as text encoding)
    as wall-clock intervals, what rank 0's traces are made of (one append per change)."""

    def __init__(self) -> None:
        self.phase, self.seconds, self._since = "idle", {}, time.perf_counter()
        self.timeline: list[Interval] = []
        self._since_ns = time.time_ns()
        self._marks: dict[str, int] = {}

    def reset(self) -> None:
        self.seconds, self.timeline, self._marks = {}, [], {}

    def enter(self, name: str) -> None:
        if name == self.phase:
            return
        now, now_ns = time.perf_counter(), time.time_ns()
        if self.phase != "idle":
            self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self._since
            self.timeline.append((self.phase, self._since_ns, now_ns))
        self.phase, self._since, self._since_ns = name, now, now_ns

    def start_mark(self, name: str) -> None:
        self._marks[name] = time.time_ns()

    def end_mark(self, name: str) -> None:
        start = self._marks.pop(name, None)
        if start is not None:
            self.timeline.append((name, start, time.time_ns()))


class Laps:
    """`lap(name)` records the seconds since the previous lap (or since `start`) under `name`."""

    def __init__(self, start: float | None = None):
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter() if start is None else start

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name], self._mark = now - self._mark, now

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.phases.items()}


def start_laps() -> Laps:
    """Laps counted from this process's start (`process_age_seconds`)."""
    return Laps(time.perf_counter() - process_age_seconds())


# Imported by diffusers or transformers whenever they are installed, needed by none of the served
# families, and not installed in the engine image: ~2 s of a Wan2.1 server's start-up on an H200
# host that had them (scipy 0.64 s, sklearn with joblib and pandas ~0.9 s, torchvision 0.13 s;
# record `pipeline-h200-2026-11-30`, calls 15 and 16). accelerate (0.09 s) is not listed: diffusers' loaders use it.
UNNEEDED_OPTIONAL_PACKAGES = ("peft", "sklearn", "scipy", "pandas", "torchvision", "onnxruntime")


def unneeded_imports(packages: tuple[str, ...] = UNNEEDED_OPTIONAL_PACKAGES) -> list[str]:
    """Which of `packages` this process imported (for the ready log's warning: an image that
    installs them pays their imports on every start)."""
    return [name for name in packages if name in sys.modules]


def uncached_bytecode(packages: tuple[str, ...] = HEAVY_PACKAGES) -> list[str]:
    """The imported `packages` whose bytecode this process neither found cached nor wrote: Python
    compiled them from source and will again in every process (`PYTHONDONTWRITEBYTECODE=1`, or a
    read-only install without `.pyc` files). Packages not imported are not reported."""
    out = []
    for name in packages:
        source = getattr(sys.modules.get(name), "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        try:
            cached = importlib.util.cache_from_source(source)  # honours sys.pycache_prefix
        except NotImplementedError:  # an interpreter without bytecode caching
            continue
        if not os.path.exists(cached):
            out.append(name)
    return out
