"""The control plane's vocabulary: every message between rank 0 and its children, as frozen data.

Owns: `RankConfig` (what every rank is started with), the messages of the control plane (children
send `Hello`, `Ready`, `StepProgress`, `Result`, `RankFailure`; rank 0 sends `WaveAssignment` and
`Stop`), `RankFacts` and `RankStats` (what a rank knows of itself, carried by `Ready` and `Result`),
`Progress` (the tick counter the watchdog reads), `RequestError` (one request failed, the wave did
not) and `WaveError`. Messages are pickled as they are
through `multiprocessing.connection`; nothing crosses the process boundary as a string-keyed dict.
Must never: import torch or anything that does I/O (rank 0's HTTP side and the metrics read these).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Literal, Union

from dlo.plan.facts import Mode
from dlo.engine.report import GatherStats, LoadReport
from dlo.engine.settings import EngineSettings
from dlo.engine.request import Generation


class WaveError(RuntimeError):
    """A wave could not finish: a rank died, stalled, or its collective broke. The engine must restart."""


@dataclass(frozen=True)
class RankConfig:
    """Every rank's start-up: the engine settings, whole, and the process plumbing of this start
    (rank 0 passes it to children through the environment, `rank_main`)."""

    model_dir: str
    settings: EngineSettings  # validated by `dlo serve`; the mode is already resolved (never "auto")
    master_port: int
    control_port: int
    max_sequence_length: int = 512  # the limits' text-encoder sequence length
    collective_timeout_s: float = 1800.0
    log_format: Literal["text", "json"] = "text"  # `dlo serve --log-format`: the ranks log as rank 0 does

    @property
    def mode(self) -> Mode:
        return self.settings.offload.mode

    @property
    def device(self) -> str:
        return self.settings.device

    @property
    def dp(self) -> int:
        return self.settings.parallel.dp

    @property
    def sp(self) -> int:
        return self.settings.parallel.sp

    @property
    def world(self) -> int:
        """Rank processes: dp sp groups of sp ranks each."""
        return self.settings.parallel.world

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "settings": self.settings.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> "RankConfig":
        data = json.loads(text)
        return cls(**{**data, "settings": EngineSettings.from_dict(data["settings"])})


@dataclass(frozen=True)
class RankStats(GatherStats):
    """A snapshot of one rank's counters: the gather counters of its streamed models together
    (`GatherStats`, the one definition of them) plus the device allocator's peak."""

    device_memory_peak_bytes: int = 0
    device_energy_joules: float | None = None  # the device's energy since the rank started; None: no counter

    @classmethod
    def of(cls, stats: GatherStats, device_memory_peak_bytes: int,
           device_energy_joules: float | None = None) -> "RankStats":
        return cls(**{f.name: getattr(stats, f.name) for f in fields(GatherStats)},
                   device_memory_peak_bytes=device_memory_peak_bytes, device_energy_joules=device_energy_joules)


@dataclass(frozen=True)
class RankFacts:
    """What a loaded rank knows of itself: the load report and the bytes of the other components."""

    report: LoadReport
    components: dict[str, int] = field(default_factory=dict)  # component name -> parameter bytes
    # component name -> {"weights_source", "host_bytes", "device_bytes"} for every component
    # (transformers from their load report, the others as loaded by diffusers)
    component_reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    # where the rank's start went, in order: joining the weight plane, then the pipeline's load steps
    load_phases: dict[str, float] = field(default_factory=dict)


# ---- child -> rank 0 ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    rank: int
    pid: int


@dataclass(frozen=True)
class Ready:
    facts: RankFacts
    stats: RankStats


@dataclass(frozen=True)
class StepProgress:
    """A progress tick; `steps_done` counts the denoising steps of the rank's current request."""

    steps_done: int


@dataclass(frozen=True)
class RequestError:
    """One request failed outside the collective schedule; its rank still did the wave's gathers.

    `phase`: where it failed (`prepare`: text encoding, scheduler set-up, latents; `denoise`: between
    transformer calls; `decode`: VAE; `encode_output`: PNG or MP4). `client_fault`: the request's
    own input caused it (HTTP 400), else the server failed it (500).
    """

    phase: str
    type: str  # the exception's class name
    message: str
    client_fault: bool = False


@dataclass(frozen=True)
class Result:
    """One rank's share of a wave: its request's encoded outputs, or None for a gather-only rank,
    or `error` when its request failed alone (the rank took part in every gather of the wave)."""

    wave: int
    stats: RankStats
    outputs: tuple[bytes, ...] | None = None  # PNG per image, or one MP4
    media_type: str = ""
    step_seconds: tuple[float, ...] = ()
    seconds: float = 0.0
    error: RequestError | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)  # the request's seconds per phase
    timeline: tuple[tuple[str, int, int], ...] = ()  # its phases and marks, wall-clock ns (PhaseClock)


@dataclass(frozen=True)
class RankFailure:
    message: str


# ---- rank 0 -> child ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WaveAssignment:
    """This rank's part of wave `wave`: `mine` to run, or None to only gather what `wave_gen` implies."""

    wave: int
    wave_gen: Generation
    mine: Generation | None


@dataclass(frozen=True)
class Stop:
    pass


ChildMessage = Union[Hello, Ready, StepProgress, Result, RankFailure]
ParentMessage = Union[WaveAssignment, Stop]


class Progress:
    """Monotonic tick counter and time of the last tick (written by the compute thread).

    `watch` (optional) is a counter the watchdog polls, such as the engine's gather count: it
    moves once per block even on a rank that only gathers, whose own ticks come once per call.
    """

    def __init__(self, watch: Callable[[], int] | None = None) -> None:
        self.count = 0
        self.last = time.monotonic()
        self.watch = watch
        self._watched = watch() if watch else 0

    def tick(self) -> None:
        self.count += 1
        self.last = time.monotonic()

    def poll(self) -> None:
        if self.watch is not None:
            value = self.watch()
            if value != self._watched:
                self._watched = value
                self.tick()


def summary(rank: int, ready: Ready | None) -> dict[str, Any]:
    """One rank's entry of `/ready` (JSON): its load report, component bytes and stats at load."""
    if ready is None:
        return {"rank": rank}
    return {"rank": rank, "report": ready.facts.report.to_dict(), "components": dict(ready.facts.components),
            "component_reports": dict(ready.facts.component_reports), "stats": asdict(ready.stats),
            "load_phases": dict(ready.facts.load_phases)}
