"""Running video jobs on the engine: record, queue, finish, sweep, and their metrics.

Owns: `VideoJobs`, what happens to a video job between its POST and its end - recorded in the store
with its tenant (who sees it) and its quota holder before it is queued (a job that could not be
recorded never runs; one the queue, or its tenant's share of it, refuses leaves no record), marked running when its wave starts, completed with its MP4 written off the event loop or
failed with the domain error's code, swept when expired - its progress in percent, the video-job
metrics (`dlo_video_jobs{state}` from the store at scrape time, `dlo_video_job_duration_seconds`
from creation to completion, `dlo_video_job_failures_total{code}`), and `finishing()`, the jobs
whose MP4 is still being written (the drain waits for them). What it needs of the engine that runs
its waves is the typed `JobHost` protocol.
Must never: keep a job in `in_progress` for ever, or hold an MP4 in memory once it is on disk
(the records and files themselves are `videos.VideoStore`'s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from dlo.serving.errors import ServiceError, VideoStorageError
from dlo.serving.metrics import EngineMetrics
from dlo.serving.tenants import EVERYONE, Caller, HeldRequests
from dlo.serving.videos import VideoJob, VideoStore

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.request import Generation

log = logging.getLogger(__name__)

VIDEO_SWEEP_S = 60.0  # how often expired video jobs are removed even when nobody asks


class JobHost(Protocol):
    """What video jobs need of the engine that runs their waves (`service.Engine`)."""

    model_id: str

    def check_available(self) -> None: ...

    def submit(self, gen: "Generation", request_id: str = "") -> asyncio.Future: ...

    def steps_done(self, rank: int) -> int: ...

    def decode_tiled(self, gen: "Generation") -> bool: ...


class VideoJobs:
    """This engine's video jobs: `create`, `start` (its wave began), `progress`, `sweep_forever`."""

    def __init__(self, store: VideoStore, host: JobHost, metrics: EngineMetrics):
        self.store, self.host, self.metrics = store, host, metrics
        self._tasks: set[asyncio.Task] = set()
        metrics.video_jobs_source(store.by_status)

    def create(self, gen: "Generation", seconds: str, caller: Caller = EVERYONE,
               held: HeldRequests | None = None) -> VideoJob:
        """Record a video job of `caller`, then queue it (against its share, `held`): a job that could
        not be recorded never runs, and one the queue refuses (`QueueFull`) leaves no record."""
        model = f"{self.host.model_id}:{gen.lora_id}" if gen.lora_id else self.host.model_id  # as the client chose
        job = VideoJob(id=self.store.new_id(), created_at=int(time.time()), model=model,
                       prompt=gen.prompt, seconds=seconds, size=f"{gen.width}x{gen.height}", steps=gen.steps,
                       client=caller.holder, tenant=caller.tenant, vae_tiled=self.host.decode_tiled(gen))
        self.host.check_available()
        try:
            self.store.add(job)
        except OSError as e:
            log.error("video %s: could not record the job: %s", job.id, e)
            raise VideoStorageError(f"the server could not record the video job: {e}") from None
        try:
            submit = lambda: self.host.submit(gen, request_id=job.id)  # noqa: E731
            fut = held.submit(caller, submit) if held is not None else submit()
        except ServiceError:
            self.store.forget(job.id)
            raise
        task = asyncio.create_task(self._finish(job.id, time.monotonic(), fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def start(self, video_id: str, rank: int) -> None:
        """Its wave started on `rank` (a no-op for anything that is not a video job)."""
        if video_id in self.store:
            self.store.start(video_id, rank)

    def progress(self, job: VideoJob) -> int:
        """Percent: denoising steps done on its rank (the last percent is the VAE decode and MP4)."""
        if job.status in ("completed", "failed"):
            return 100
        if job.status == "queued" or job.rank is None:
            return 0
        return min(99, 100 * self.host.steps_done(job.rank) // max(1, job.steps))

    def finishing(self) -> int:
        """Jobs whose wave is queued, running, or whose MP4 is being written."""
        return len(self._tasks)

    async def _finish(self, video_id: str, created: float, fut: asyncio.Future) -> None:
        try:
            res = await fut
        except ServiceError as e:
            self._failed(video_id, e.code, e.message)
            return
        except Exception as e:  # never leave a job in_progress for ever
            log.exception("video %s failed", video_id)
            self._failed(video_id, "internal_error", f"{type(e).__name__}: {e}")
            return
        assert res.outputs is not None
        try:  # the MP4 goes to disk off the event loop; the record changes in it
            await asyncio.to_thread(self.store.write_content, video_id, res.outputs[0])
        except OSError as e:
            log.error("video %s: could not write its MP4: %s", video_id, e)
            self._failed(video_id, "storage_error", f"the server could not store the video: {e}")
        else:
            if self.store.complete(video_id, res.phase_seconds) is not None:
                self.metrics.video_job_duration.observe(time.monotonic() - created)

    def _failed(self, video_id: str, code: str, message: str) -> None:
        if self.store.fail(video_id, code, message) is not None:
            self.metrics.video_job_failures.labels(code).inc()

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(VIDEO_SWEEP_S, self.store.ttl_s / 4))
            self.store.sweep()
            await asyncio.to_thread(self.store.sweep_folder)
