"""Running video jobs on the engine: record, queue, finish, sweep (a mixin of `service.Engine`).

Owns: what happens to a video job between its POST and its end - recorded in the store before it is
queued (a job that could not be recorded never runs; one the queue refuses leaves no record), marked
running when its wave starts, completed with its MP4 written off the event loop or failed with the
domain error's code, swept when expired, and its progress in percent.
Must never: keep a job in `in_progress` for ever, or hold an MP4 in memory once it is on disk
(the records and files themselves are `videos.VideoStore`'s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from dlo.engine.serving.errors import ServiceError, VideoStorageError
from dlo.engine.serving.videos import VideoJob

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.request import Generation
    from dlo.engine.serving.waves import Pending

log = logging.getLogger(__name__)

VIDEO_SWEEP_S = 60.0  # how often expired video jobs are removed even when nobody asks


class VideoRunner:
    """The video half of `Engine`: needs its `videos`, `model_id`, `group`, `_video_tasks`,
    `check_available()` and `submit()`."""

    def _mark_video(self, p: Pending, rank: int) -> None:
        if p.request_id in self.videos:
            self.videos.start(p.request_id, rank)

    def video_progress(self, job: VideoJob) -> int:
        """Percent: denoising steps done on its rank (the last percent is the VAE decode and MP4)."""
        if job.status in ("completed", "failed"):
            return 100
        if job.status == "queued" or job.rank is None:
            return 0
        return min(99, 100 * self.group.steps_done(job.rank) // max(1, job.steps))

    def create_video(self, gen: Generation, seconds: str) -> VideoJob:
        """Record a video job, then queue it: a job that could not be recorded never runs, and one the
        queue refuses (`QueueFull`) leaves no record."""
        model = f"{self.model_id}:{gen.lora_id}" if gen.lora_id else self.model_id  # the id the client chose
        job = VideoJob(id=self.videos.new_id(), created_at=int(time.time()), model=model, prompt=gen.prompt,
                       seconds=seconds, size=f"{gen.width}x{gen.height}", steps=gen.steps)
        self.check_available()
        try:
            self.videos.add(job)
        except OSError as e:
            log.error("video %s: could not record the job: %s", job.id, e)
            raise VideoStorageError(f"the server could not record the video job: {e}") from None
        try:
            fut = self.submit(gen, request_id=job.id)
        except ServiceError:
            self.videos.forget(job.id)
            raise
        task = asyncio.create_task(self._finish_video(job.id, fut))
        self._video_tasks.add(task)
        task.add_done_callback(self._video_tasks.discard)
        return job

    async def _finish_video(self, video_id: str, fut: asyncio.Future) -> None:
        try:
            res = await fut
        except ServiceError as e:
            self.videos.fail(video_id, e.code, e.message)
            return
        except Exception as e:  # never leave a job in_progress for ever
            log.exception("video %s failed", video_id)
            self.videos.fail(video_id, "internal_error", f"{type(e).__name__}: {e}")
            return
        assert res.outputs is not None
        try:  # the MP4 goes to disk off the event loop; the record changes in it
            await asyncio.to_thread(self.videos.write_content, video_id, res.outputs[0])
        except OSError as e:
            log.error("video %s: could not write its MP4: %s", video_id, e)
            self.videos.fail(video_id, "storage_error", f"the server could not store the video: {e}")
        else:
            self.videos.complete(video_id)

    async def _sweep_videos(self) -> None:
        while True:
            await asyncio.sleep(min(VIDEO_SWEEP_S, self.videos.ttl_s / 4))
            self.videos.sweep()
