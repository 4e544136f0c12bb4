"""The serving engine on rank 0: readiness, the wave scheduler, fault handling.

Owns: the lifecycle `loading -> ready -> draining -> stopping`, any state -> `failed` (`State`,
changed only through `_enter`); the drain on SIGTERM (`begin_drain`: `/ready` 503 at once, new
requests refused with `ShuttingDown`, the waves, queue and video jobs already accepted run up to
`shutdown_grace_s` - a finished job's MP4 is on disk before the pod goes - what is left then fails
with `ShuttingDown`, a wave still running is abandoned: its ranks are killed, never waited for);
the asyncio scheduler that drains `WaveQueue` into `RankGroup.run_wave` one wave at a time;
withdrawing a request whose client left (`withdraw`: dropped while queued, a running one finishes
its wave); the startup deadline (`unhealthy_reason`); and faults: every request of the wave and
queue fails with `EngineFailed` naming the cause, `/health` turns unhealthy, the server exits
non-zero (`RankGroup.kill` and a hard exit follow if anything is stuck in a collective). Video jobs
are `video_jobs.VideoJobs`, composed in. Refusals are domain errors; the server maps them to HTTP.
Must never: speak HTTP (no status codes here), block the event loop on the ranks (waves run in a
daemon thread), signal the ranks' processes itself (ask `RankGroup`), or run a wave after a fault.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from dlo.engine.families import PipelineFacts
from dlo.engine.families.pipelines import WARMUP_STEPS
from dlo.engine.parallel import Layout, LayoutError, check_tokens, leader_results, wave_assignments
from dlo.engine.request import Generation
from dlo.serving.control import RankConfig, Result, WaveError, summary
from dlo.serving.errors import (EngineFailed, EngineUnavailable, InvalidRequest, QueueFull, ServiceError,
                                       ShuttingDown, request_failed)
from dlo.plan.limits import Limits
from dlo.serving.metrics import EngineMetrics
from dlo.serving.ranks import RankGroup
from dlo.serving.startup import WarmUp, startup_phases, warn_about_start_costs
from dlo.serving.threads import WaveThread, in_daemon_thread
from dlo.engine.timing import Laps, process_age_seconds
from dlo.serving.video_jobs import VideoJobs
from dlo.serving.videos import VideoStore
from dlo.serving.waves import Pending, WaveQueue

log = logging.getLogger(__name__)

HARD_EXIT_AFTER_S = 15.0
MAX_RETRY_AFTER_S = 60

# loading -> ready -> draining -> stopping; any state -> failed (a fault is final: the process exits).
State = Literal["loading", "ready", "draining", "stopping", "failed"]
# Left to stop the ranks after the drain deadline before the process must be gone (grace + 2 s).
STOP_AFTER_DRAIN_S = 1.5


@dataclass(frozen=True)
class EngineOptions:
    """How rank 0's service runs (the `dlo serve` flags of the same names)."""

    progress_timeout_s: float = 300.0
    max_queue: int = 64
    wave_window_ms: float = 5.0
    warmup: bool = True
    warmup_size: tuple[int, int] | None = None
    warmup_steps: int = WARMUP_STEPS
    shutdown_grace_s: float = 25.0
    startup_timeout_s: float = 900.0
    adapters: Mapping[str, str] = field(default_factory=dict)  # --lora-dir: name -> its file or folder
    start_laps: Laps | None = None  # `dlo serve`'s steps before the load, from the process's start
    plan: Mapping[str, Any] | None = None  # the deployment plan it runs (`DeploymentPlan.to_dict`), for /ready
    vae_tiling: str = "auto"  # `--vae-tiling`: never refuses a request whose decode the plan tiles


class Engine:
    def __init__(self, cfg: RankConfig, *, limits: Limits, facts: PipelineFacts, model_id: str,
                 videos: VideoStore | None = None, options: EngineOptions = EngineOptions()):
        self.cfg, self.limits, self.facts, self.model_id, self.options = cfg, limits, facts, model_id, options
        self.adapters: dict[str, str] = dict(options.adapters)  # every rank loads them; checked at start
        self.max_queue, self.window_s = options.max_queue, options.wave_window_ms / 1000.0
        self.state: State = "loading"
        self.failure: str | None = None
        self.exit_code = 0
        self.request_exit: Callable[[], None] = lambda: None
        self.group = RankGroup(cfg, options.progress_timeout_s, self._on_fault)
        self.waves = WaveThread()  # rank 0's waves, the warm-up's first, on one thread (its libraries' state)
        self.layout = Layout(cfg.dp, cfg.sp)  # a wave: up to dp requests, each on its sp ranks
        self.metrics = EngineMetrics(cfg.dp, self._rank_facts)
        self.created = int(time.time())
        self.started = time.monotonic()
        if videos is None:  # callers other than `dlo serve`: a store of its own, gone with the temp dir
            videos = VideoStore(tempfile.mkdtemp(prefix="dlo-videos-"))
            videos.load()
        self.videos = videos  # loaded by the caller (`dlo serve` refuses an unusable --video-dir up front)
        self.jobs = VideoJobs(videos, self, self.metrics)
        self.waves_run = 0
        self.warm = WarmUp(facts, cfg.sp, Path(cfg.model_dir), options.warmup, options.warmup_size, options.warmup_steps)
        self.warmup_seconds: float | None = None
        self.startup_seconds: dict[str, Any] = {}  # set at ready (`_load`): seconds, and rank 0's phases
        self._queue: WaveQueue | None = None
        self._inflight: list[Pending] = []
        self.shutdown_grace_s = options.shutdown_grace_s
        self.drain_deadline: float | None = None  # monotonic; set by begin_drain
        self.wave_running = False
        self._drained = asyncio.Event()
        self._wave_done = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --------------------------------------------------------------------------------
    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = WaveQueue(self.cfg.dp, self.window_s, self.max_queue)
        self._tasks.append(asyncio.create_task(self.jobs.sweep_forever()))
        self._tasks.append(asyncio.create_task(self._load()))

    async def _load(self) -> None:
        """Start the ranks, warm every one up, then turn ready and start the scheduler."""
        t0 = time.perf_counter()
        before_load = process_age_seconds()  # interpreter start, imports, arguments, the HTTP server
        before_laps = self.options.start_laps
        if before_laps is not None:
            before_laps.lap("rank_spawn_and_http_server")
        if not await self._start_ranks():
            return
        t1 = time.perf_counter()
        warm = await self._warm_up() if self.warm.enabled else {}  # rank 0's warm-up phases; None: it failed
        if warm is None or self.state != "loading":
            return
        ready0 = self.group.ranks[0].ready
        assert ready0 is not None  # start() returned: every rank is ready
        self.metrics.set_info(self.cfg.mode, self.cfg.dp, self.facts.family, self.cfg.device,
                              ready0.facts.report.weights_source)
        self._enter("ready")
        self.startup_seconds = startup_phases(before_load, t1 - t0, self.warmup_seconds, ready0.facts.load_phases, warm,
                                              before_laps.rounded() if before_laps is not None else {})
        log.info("engine ready mode=%s dp=%d family=%s device=%s seconds=%.1f warmup_seconds=%s startup=%s",
                 self.cfg.mode, self.cfg.dp, self.facts.family, self.cfg.device, time.perf_counter() - t0,
                 "off" if self.warmup_seconds is None else f"{self.warmup_seconds:.2f}", self.startup_seconds)
        self._tasks.append(asyncio.create_task(self._schedule()))
        warn_about_start_costs()

    async def _start_ranks(self) -> bool:
        try:
            await in_daemon_thread(self.group.start)
        except Exception as e:
            if self.failure is None:  # a rank's own fault report already said why
                log.exception("engine failed to start")
                self._on_fault(f"engine failed to start: {e}")
            return False
        return self.state == "loading"

    async def _warm_up(self) -> dict[str, float] | None:
        """The warm-up wave on every rank: rank 0's request phases (`warmup_*`), None when it failed."""
        t0 = time.perf_counter()
        try:
            warm = [self.warm.generation()] * self.cfg.world
            results = await self.waves.run(lambda: self.group.run_wave(warm))
            failed = [(r, res.error) for r, res in enumerate(results) if res.error is not None]
            if failed:
                rank, err = failed[0]
                raise WaveError(f"rank {rank} phase={err.phase}: {err.message}")
        except Exception as e:  # a pipeline that cannot run its smallest request never serves
            if self.failure is None:
                log.exception("warm-up failed")
                self._on_fault(f"warm-up failed: {type(e).__name__}: {e}")
            return None
        self.warmup_seconds = time.perf_counter() - t0
        return {f"warmup_{k}": round(v, 2) for k, v in results[0].phase_seconds.items()}

    def _enter(self, state: State) -> None:
        """The one place the lifecycle changes (and `dlo_ready` with it); `failed` is final."""
        if self.state == "failed" or self.state == state:
            return
        log.info("engine state %s -> %s", self.state, state)
        self.state = state
        self.metrics.ready.set(1 if state == "ready" else 0)

    # -- drain (SIGTERM) ---------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """SIGTERM (in the event loop): stop taking requests, finish what was accepted within the
        grace, fail the rest, then ask the server to exit. A second call ends the drain now."""
        if self.state == "draining":
            log.warning("second stop signal: ending the drain now")
            self.drain_deadline = time.monotonic()
            self._drained.set()
            return
        if self.state != "ready":  # loading, stopping or failed: nothing accepted to finish
            self.request_exit()
            return
        self.drain_deadline = time.monotonic() + self.shutdown_grace_s
        self._enter("draining")
        log.info("draining: running=%d queued=%d grace_seconds=%g", len(self._inflight),
                 len(self._queue) if self._queue else 0, self.shutdown_grace_s)
        self._tasks.append(asyncio.create_task(self._drain()))

    async def _drain(self) -> None:
        assert self.drain_deadline is not None and self._queue is not None
        t0 = time.monotonic()
        while not self._drained.is_set() and (self.wave_running or len(self._queue) or self.jobs.finishing()):
            left = self.drain_deadline - time.monotonic()
            if left <= 0:
                break
            self._wave_done.clear()
            try:
                await asyncio.wait_for(self._wave_done.wait(), timeout=min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        left_over = len(self._inflight) + len(self._queue)
        log.info("drain done seconds=%.2f unfinished=%d wave_running=%s video_jobs_finishing=%d",
                 time.monotonic() - t0, left_over, self.wave_running, self.jobs.finishing())
        self._enter("stopping")
        self._fail_waiting(ShuttingDown(
            f"the server is shutting down and this request did not finish within the {self.shutdown_grace_s:g} s "
            "shutdown grace; retry it (another replica will take it)"))
        self.request_exit()

    async def shutdown(self) -> None:
        self._enter("stopping")
        for t in self._tasks:
            t.cancel()
        self._fail_waiting(ShuttingDown("the server is shutting down"))
        if self.wave_running:
            # A wave still runs (the grace ran out, or no drain): its ranks are in the middle of
            # their collective and cannot be stopped politely. Kill them; the process exits next.
            log.warning("a wave is still running at shutdown: abandoning it (its ranks are killed)")
            await in_daemon_thread(self.group.abandon)
            return
        stop = in_daemon_thread(self.group.stop)
        if self.drain_deadline is None:
            await stop
            return
        # After a drain the process must be gone by the end of the grace (plus a little): the
        # polite stop is bounded by what is left of it.
        budget = max(0.5, self.drain_deadline + STOP_AFTER_DRAIN_S - time.monotonic())
        try:
            await asyncio.wait_for(stop, timeout=budget)
        except asyncio.TimeoutError:
            log.warning("the ranks did not stop within %.1f s after the drain; killing them", budget)
            await in_daemon_thread(self.group.abandon)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def unhealthy_reason(self) -> str | None:
        """Why `/health` is 503 now: a fault, or loading for longer than the startup deadline (a start
        that hangs, say on a peer that never answers, must not look healthy for ever)."""
        if self.state == "failed":
            return self.failure
        waited, limit = time.monotonic() - self.started, self.options.startup_timeout_s
        stuck = self.state == "loading" and waited > limit
        return f"still loading after {waited:.0f} s (--startup-timeout {limit:g}): the start is stuck" if stuck else None

    def steps_done(self, rank: int) -> int:
        return self.group.steps_done(rank)

    def occupancy(self) -> dict[str, int]:
        """Requests in the running wave and waiting in the queue (`/health`)."""
        return {"running": len(self._inflight) if self.wave_running else 0,
                "queued": len(self._queue) if self._queue else 0}

    def _rank_facts(self) -> dict[int, dict]:
        """Per rank, the latest load report and stats as plain numbers (the metrics exposition)."""
        return {st.rank: {"report": st.ready.facts.report.to_dict() if st.ready else None,
                          "stats": asdict(st.stats) if st.stats else None} for st in self.group.ranks}

    def rank_summary(self) -> list[dict]:
        return [summary(st.rank, st.ready) for st in self.group.ranks]

    # -- faults -----------------------------------------------------------------------------------
    def _on_fault(self, reason: str) -> None:
        """Any thread: fail everything waiting, turn unhealthy, exit non-zero."""
        self.failure = reason
        self.exit_code = 1
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all)
        threading.Thread(target=self._hard_exit, name="hard-exit", daemon=True).start()

    def _fail_all(self) -> None:
        self._enter("failed")
        self._fail_waiting(self._failed_error())
        # let the 503s go out before the server stops
        assert self._loop is not None
        self._loop.call_later(0.5, self.request_exit)

    def _failed_error(self) -> EngineFailed:
        return EngineFailed(f"engine failed: {self.failure}; the server is restarting")

    def _fail_waiting(self, err: ServiceError) -> None:
        waiting = list(self._inflight) + (self._queue.drain() if self._queue else [])
        for p in waiting:
            if p.future is not None and not p.future.done():
                p.future.set_exception(err)
        self.metrics.queue_depth.set(0)
        self.metrics.requests_running.set(0)

    def _hard_exit(self) -> None:
        time.sleep(HARD_EXIT_AFTER_S)
        log.error("exiting: the server did not stop within %.0f s of the fault", HARD_EXIT_AFTER_S)
        self.group.kill()
        os._exit(1)

    def check_available(self) -> None:
        """Raise `EngineFailed`, `ShuttingDown` or `EngineUnavailable` unless requests are taken now."""
        if self.state == "failed":
            raise self._failed_error()
        if self.state in ("draining", "stopping"):
            raise ShuttingDown("the server is shutting down; retry (another replica will take it)")
        if self.state != "ready":
            raise EngineUnavailable(f"the engine is {self.state}; retry shortly")

    def submit(self, gen: Generation, request_id: str = "") -> asyncio.Future:
        """Queue one generation; the future resolves to its rank's `Result` (raises `QueueFull`)."""
        self.check_available()
        try:  # with sp > 1 each frame's tokens split over the sp ranks
            check_tokens(gen.width, gen.height, self.facts.size_multiple, self.cfg.sp) if self.cfg.sp > 1 else None
        except LayoutError as e:
            raise InvalidRequest(str(e)) from None
        if (tiled := self.decode_tiled(gen)) and self.options.vae_tiling == "never":  # plain cannot fit: 400
            raise InvalidRequest(f"size {gen.width}x{gen.height} x {max(1, gen.frames)} frames x {gen.n}: its decode "
                                 "does not fit the device budget plain and this server runs --vae-tiling never")
        assert self._queue is not None and self._loop is not None
        fut = self._loop.create_future()
        try:
            self._queue.put(Pending(gen, time.monotonic(), fut, request_id=request_id))
            self.metrics.vae_tiled.labels(gen.kind).inc(tiled)
        except QueueFull as e:
            e.retry_after_s = self._retry_after_s()
            raise
        self.metrics.queue_depth.set(len(self._queue))
        return fut

    def decode_tiled(self, gen: Generation) -> bool:  # on its rank: the rank's rule, the same settings
        return self.facts.adapter.decode_tiled(gen, self.cfg.settings.vae_tile_above_pixels)

    def withdraw(self, fut: asyncio.Future) -> bool:
        """The client of `fut` left: drop its request while it is queued (True: it never reaches the
        ranks); a request in the running wave finishes it (its result is dropped; False)."""
        assert self._queue is not None
        fut.cancel()
        dropped = self._queue.remove_future(fut)
        self.metrics.queue_depth.set(len(self._queue))
        return dropped

    async def _schedule(self) -> None:
        assert self._queue is not None
        while self.state in ("ready", "draining"):
            wave = await self._queue.take_wave()
            self.metrics.queue_depth.set(len(self._queue))
            if self.state not in ("ready", "draining"):
                return
            self._inflight = wave
            self.metrics.requests_running.set(len(wave))
            for p, rank in zip(wave, self.layout.leaders()):
                self.jobs.start(p.request_id, rank)
            assignments = wave_assignments([p.gen for p in wave], self.layout)
            t0 = time.perf_counter()
            self.wave_running = True
            try:
                results: list[Result] = await self.waves.run(lambda: self.group.run_wave(assignments))
            except WaveError as e:
                log.error("wave failed: %s", e)
                return  # _on_fault fails the futures and stops the server
            except Exception as e:  # a bug, not a rank failure: still never reuse the group
                log.exception("wave failed")
                self.group.fault(f"wave failed: {type(e).__name__}: {e}")
                return
            self.waves_run += 1
            self.metrics.wave_size.observe(len(wave))
            self.metrics.wave_duration.observe(time.perf_counter() - t0)
            log.info("wave %d size=%d key=%s seconds=%.2f", self.waves_run, len(wave), wave[0].key,
                     time.perf_counter() - t0)
            for rank, (p, res) in zip(self.layout.leaders(), zip(wave, leader_results(results, self.layout, len(wave)))):
                for s in res.step_seconds:
                    self.metrics.step_duration.observe(s)
                if p.future is None or p.future.done():
                    continue
                if res.error is not None:
                    # failed alone: its rank still did the wave's gathers; the engine serves on
                    log.warning("request failed rank=%d wave=%d phase=%s: %s", rank, self.waves_run, res.error.phase,
                                res.error.message)
                    p.future.set_exception(request_failed(res.error))
                else:
                    p.future.set_result(res)
            self._inflight = []
            self.wave_running = False
            self.metrics.requests_running.set(0)
            self._wave_done.set()

    def _retry_after_s(self) -> int:
        """A hint for a refused client: the waves queued ahead of it times the mean wave time so far."""
        waves_ahead = math.ceil(len(self._queue or ()) / self.cfg.dp)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.metrics.mean_wave_seconds() * max(1, waves_ahead))))
