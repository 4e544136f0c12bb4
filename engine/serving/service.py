"""The serving engine on rank 0: readiness, the wave scheduler, video jobs, fault handling.

Owns: the lifecycle `loading -> ready -> (stopping | failed)` (`State`, changed only through
`_enter`), the asyncio scheduler that drains `WaveQueue` into `RankGroup.run_wave` one wave at a
time, the video job store, and what happens on a fault: every request of the wave and of the queue
fails with `EngineFailed` naming the cause, `/health` turns unhealthy, and the server is asked to
exit non-zero (`RankGroup.kill` and a hard exit follow if anything is stuck in a collective).
Refusals are domain errors (`dlo.engine.serving.errors`); the server maps them to HTTP.
Must never: speak HTTP (no status codes here), block the event loop on the ranks (waves run in a
daemon thread), signal the ranks' processes itself (ask `RankGroup`), or run a wave after a fault.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from dataclasses import asdict
from typing import Any, Callable, Literal

from dlo.engine.families import PipelineFacts
from dlo.engine.parallel import Layout, LayoutError, check_tokens, leader_results, wave_assignments
from dlo.engine.serving.control import RankConfig, Result, WaveError, summary
from dlo.engine.serving.errors import EngineFailed, EngineUnavailable, InvalidRequest, ServiceError, ShuttingDown
from dlo.engine.serving.limits import Limits
from dlo.engine.serving.metrics import EngineMetrics
from dlo.engine.serving.ranks import RankGroup
from dlo.engine.serving.waves import Generation, Pending, WaveQueue

log = logging.getLogger(__name__)

HARD_EXIT_AFTER_S = 15.0
MAX_VIDEO_JOBS = 256

# loading -> ready -> stopping; any state -> failed (a fault is final: the process exits).
State = Literal["loading", "ready", "stopping", "failed"]


@dataclass
class VideoJob:
    id: str
    gen: Generation
    seconds: str
    created_at: int
    status: str = "queued"
    completed_at: int | None = None
    content: bytes | None = None
    error: dict[str, str] | None = None
    rank: int | None = None  # the rank running it, once its wave started
    task: asyncio.Task | None = field(default=None, repr=False)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run fn in a daemon thread: a rank stuck in a collective must never block process exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            res = fn()
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, fut, None, e)
        else:
            loop.call_soon_threadsafe(_settle, fut, res, None)

    threading.Thread(target=target, name="wave", daemon=True).start()
    return fut


class Engine:
    def __init__(self, cfg: RankConfig, *, limits: Limits, facts: PipelineFacts, model_id: str,
                 progress_timeout_s: float, max_queue: int, wave_window_ms: float, warmup: bool = True,
                 warmup_size: tuple[int, int] | None = None):
        self.cfg, self.limits, self.facts, self.model_id = cfg, limits, facts, model_id
        self.max_queue, self.window_s = max_queue, wave_window_ms / 1000.0
        self.state: State = "loading"
        self.failure: str | None = None
        self.exit_code = 0
        self.request_exit: Callable[[], None] = lambda: None
        self.group = RankGroup(cfg, progress_timeout_s, self._on_fault)
        self.layout = Layout(cfg.dp, cfg.sp)  # a wave: up to dp requests, each on its sp ranks
        self.metrics = EngineMetrics(cfg.dp, self._rank_facts)
        self.created = int(time.time())
        self.videos: dict[str, VideoJob] = {}
        self.waves_run = 0
        self.warmup = warmup
        self.warmup_size = warmup_size
        self.warmup_seconds: float | None = None
        self._queue: WaveQueue | None = None
        self._inflight: list[Pending] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --------------------------------------------------------------------------------
    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = WaveQueue(self.cfg.dp, self.window_s, self.max_queue)
        self._tasks.append(asyncio.create_task(self._load()))

    async def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            await _in_daemon_thread(self.group.start)
        except Exception as e:
            if self.failure is None:  # a rank's own fault report already said why
                log.exception("engine failed to start")
                self._on_fault(f"engine failed to start: {e}")
            return
        if self.state != "loading":
            return
        ready0 = self.group.ranks[0].ready
        assert ready0 is not None  # start() returned: every rank is ready
        if self.warmup:
            t1 = time.perf_counter()
            try:
                await _in_daemon_thread(lambda: self.group.run_wave([self.warmup_generation()] * self.cfg.world))
            except Exception as e:  # a pipeline that cannot run its smallest request never serves
                if self.failure is None:
                    log.exception("warm-up failed")
                    self._on_fault(f"warm-up failed: {type(e).__name__}: {e}")
                return
            self.warmup_seconds = time.perf_counter() - t1
        if self.state != "loading":
            return
        self.metrics.set_info(self.cfg.mode, self.cfg.dp, self.facts.family, self.cfg.device,
                              ready0.facts.report.weights_source)
        self._enter("ready")
        log.info("engine ready mode=%s dp=%d family=%s device=%s seconds=%.1f warmup_seconds=%s", self.cfg.mode,
                 self.cfg.dp, self.facts.family, self.cfg.device, time.perf_counter() - t0,
                 "off" if self.warmup_seconds is None else f"{self.warmup_seconds:.2f}")
        self._tasks.append(asyncio.create_task(self._schedule()))

    def warmup_generation(self) -> Generation:
        """The smallest valid request (or `--warmup-size`), run once by every rank before `/ready` turns 200: it goes
        through every path a request uses (text encoder, transformer with its gathers and transfer
        graphs, every CFG branch, scheduler, VAE decode, encoding), so library initialisation and
        first-call costs are paid before the first client, not by it."""
        m = self.facts.size_multiple
        w, h = self.warmup_size or (m * self.cfg.sp, m)  # sp > 1: tokens per frame split over the sp ranks
        return Generation(kind="image", prompt="warm-up", seed=0, width=w, height=h, steps=2,
                          guidance_scale=self.facts.default_guidance)

    def _enter(self, state: State) -> None:
        """The one place the lifecycle changes (and `dlo_ready` with it); `failed` is final."""
        if self.state == "failed" or self.state == state:
            return
        log.info("engine state %s -> %s", self.state, state)
        self.state = state
        self.metrics.ready.set(1 if state == "ready" else 0)

    async def shutdown(self) -> None:
        self._enter("stopping")
        for t in self._tasks:
            t.cancel()
        self._fail_waiting(ShuttingDown("the server is shutting down"))
        await _in_daemon_thread(self.group.stop)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

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

    def _hard_exit(self) -> None:
        time.sleep(HARD_EXIT_AFTER_S)
        log.error("exiting: the server did not stop within %.0f s of the fault", HARD_EXIT_AFTER_S)
        self.group.kill()
        os._exit(1)

    # -- requests ---------------------------------------------------------------------------------
    def check_available(self) -> None:
        """Raise `EngineFailed` or `EngineUnavailable` unless requests are taken now."""
        if self.state == "failed":
            raise self._failed_error()
        if self.state != "ready":
            raise EngineUnavailable(f"the engine is {self.state}; retry shortly")

    def submit(self, gen: Generation, request_id: str = "") -> asyncio.Future:
        """Queue one generation; the future resolves to its rank's `Result` (raises `QueueFull`)."""
        self.check_available()
        try:
            check_tokens(gen.width, gen.height, self.facts.size_multiple, self.cfg.sp)
        except LayoutError as e:
            raise InvalidRequest(str(e)) from None
        assert self._queue is not None and self._loop is not None
        fut = self._loop.create_future()
        self._queue.put(Pending(gen, time.monotonic(), fut, request_id=request_id))
        self.metrics.queue_depth.set(len(self._queue))
        return fut

    async def _schedule(self) -> None:
        assert self._queue is not None
        while self.state == "ready":
            wave = await self._queue.take_wave()
            self.metrics.queue_depth.set(len(self._queue))
            if self.state != "ready":
                return
            self._inflight = wave
            for p, rank in zip(wave, self.layout.leaders()):
                self._mark_video(p, rank)
            assignments = wave_assignments([p.gen for p in wave], self.layout)
            t0 = time.perf_counter()
            try:
                results: list[Result] = await _in_daemon_thread(lambda: self.group.run_wave(assignments))
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
            for p, res in zip(wave, leader_results(results, self.layout, len(wave))):
                for s in res.step_seconds:
                    self.metrics.step_duration.observe(s)
                if p.future is not None and not p.future.done():
                    p.future.set_result(res)
            self._inflight = []

    def _mark_video(self, p: Pending, rank: int) -> None:
        job = self.videos.get(p.request_id)
        if job is not None and job.status == "queued":
            job.status, job.rank = "in_progress", rank

    def video_progress(self, job: VideoJob) -> int:
        """Percent: denoising steps done on its rank (the last percent is the VAE decode and MP4)."""
        if job.status in ("completed", "failed"):
            return 100
        if job.status == "queued" or job.rank is None:
            return 0
        return min(99, 100 * self.group.steps_done(job.rank) // max(1, job.gen.steps))

    # -- videos -----------------------------------------------------------------------------------
    def create_video(self, gen: Generation, seconds: str) -> VideoJob:
        job = VideoJob(id=f"video_{uuid.uuid4().hex}", gen=gen, seconds=seconds, created_at=int(time.time()))
        fut = self.submit(gen, request_id=job.id)
        job.task = asyncio.create_task(self._finish_video(job, fut))
        self.videos[job.id] = job
        self._evict_videos()
        return job

    async def _finish_video(self, job: VideoJob, fut: asyncio.Future) -> None:
        try:
            res = await fut
        except ServiceError as e:
            job.status, job.error = "failed", {"code": e.code, "message": e.message}
        else:
            assert res.outputs is not None
            job.status, job.content = "completed", res.outputs[0]
        job.completed_at = int(time.time())

    def _evict_videos(self) -> None:
        done = [j for j in self.videos.values() if j.status in ("completed", "failed")]
        for j in done[: max(0, len(self.videos) - MAX_VIDEO_JOBS)]:
            del self.videos[j.id]
