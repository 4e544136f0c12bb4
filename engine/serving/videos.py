"""The video job store: every `/v1/videos` job of this pod, in memory and on disk.

Owns: job ids (`video_<pod>_<hex>` when the pod is named, so any pod can tell whose a job is), the
job records and their lifecycle (`queued -> in_progress -> completed | failed`), listing with
OpenAI's cursor (`limit`, `after`, `order`), deletion, expiry (`expires_at` = finish + TTL, then the
record and its MP4 go), and persistence: one `<id>.json` sidecar per job plus `<id>.mp4` once it
completed, each written atomically (temp file + rename) in the store's folder. On start the store
reloads the folder: finished jobs come back until they expire, a job that was queued or running
when the process stopped comes back `failed` with code `server_restarted`.
Must never: speak HTTP (refusals are domain errors of `dlo.engine.serving.errors`), hold MP4 bytes
in memory after they are written, or trust a file name it did not make (ids are checked before
they touch the folder).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from dlo.engine.serving.errors import VideoElsewhere, VideoNotFinished, VideoNotFound, VideoNotReady

log = logging.getLogger(__name__)

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
FINISHED = ("completed", "failed")
DEFAULT_TTL_S = 3600.0
MAX_VIDEO_JOBS = 256
# Pod names are DNS labels (RFC 1123): never an underscore, so the id splits unambiguously.
_POD = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ID = re.compile(r"^video_(?:(?P<pod>[a-z0-9][-a-z0-9]{0,62})_)?(?P<hex>[0-9a-f]{32})$")
SIDECAR_VERSION = 1


def default_video_dir(port: int) -> Path:
    """Outside a pod: one folder per port under the system temp dir, so that a restart on the same
    port finds its jobs again and two servers on one host never share a folder."""
    return Path(tempfile.gettempdir()) / f"dlo-videos-{port}"


def pod_of(video_id: str) -> str | None:
    """The pod a job id names (None for an unnamed id or one that is not ours to parse)."""
    m = _ID.match(video_id)
    return m.group("pod") if m else None


@dataclass
class VideoJob:
    """One job. `steps` sizes its progress; `rank` is the rank running it once its wave started."""

    id: str
    created_at: int
    model: str
    prompt: str | None
    seconds: str
    size: str
    steps: int
    status: VideoStatus = "queued"
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None
    rank: int | None = field(default=None, compare=False)

    def sidecar(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("rank")
        return {"version": SIDECAR_VERSION, **data}

    @classmethod
    def from_sidecar(cls, data: dict[str, Any]) -> "VideoJob":
        if data.get("version") != SIDECAR_VERSION:
            raise ValueError(f"sidecar version {data.get('version')!r}, expected {SIDECAR_VERSION}")
        fields = {k: data[k] for k in ("id", "created_at", "model", "prompt", "seconds", "size", "steps", "status",
                                       "completed_at", "expires_at", "error")}
        if fields["status"] not in ("queued", "in_progress", "completed", "failed"):
            raise ValueError(f"unknown status {fields['status']!r}")
        return cls(**fields)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, flush it to disk, then rename over `path`: a reader
    (or a restart) sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class VideoStore:
    """`store = VideoStore(folder, ttl_s=3600, pod="wan-0"); store.load()`, then create/get/list/delete."""

    def __init__(self, folder: Path | str, *, ttl_s: float = DEFAULT_TTL_S, pod: str | None = None,
                 max_jobs: int = MAX_VIDEO_JOBS, clock: Callable[[], float] = time.time):
        if ttl_s <= 0:
            raise ValueError(f"the video TTL must be > 0 seconds, got {ttl_s:g}")
        if pod is not None and not _POD.match(pod):
            raise ValueError(f"pod name {pod!r} is not a DNS label (lowercase letters, digits, '-')")
        self.folder, self.ttl_s, self.pod, self.max_jobs, self.clock = Path(folder), ttl_s, pod, max_jobs, clock
        self._jobs: dict[str, VideoJob] = {}  # insertion order = creation order

    # -- start ----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Create the folder and reload it: finished jobs come back until they expire; jobs that were
        queued or running when the process stopped come back failed (`server_restarted`)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob(".*.tmp"):  # a write the previous process did not finish
            tmp.unlink(missing_ok=True)
        jobs: list[VideoJob] = []
        for path in self.folder.glob("video_*.json"):
            try:
                job = VideoJob.from_sidecar(json.loads(path.read_text()))
                if job.id != path.stem or not _ID.match(job.id):
                    raise ValueError(f"the sidecar holds id {job.id!r}")
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("video store: ignoring and removing unreadable sidecar %s: %s", path, e)
                self._remove_files(path.stem)
                continue
            jobs.append(job)
        now = int(self.clock())
        restarted = 0
        for job in sorted(jobs, key=lambda j: (j.created_at, j.id)):
            if job.status not in FINISHED:
                restarted += 1
                self._finish(job, "failed", now, error={
                    "code": "server_restarted",
                    "message": "the server restarted while this job was queued or running; create it again"})
            elif job.status == "completed" and not self._mp4(job.id).exists():
                self._finish(job, "failed", now, error={
                    "code": "content_lost", "message": "the video file of this job is gone; create it again"})
            self._jobs[job.id] = job
        expired = self.sweep()
        log.info("video store folder=%s ttl=%gs pod=%s reloaded=%d restarted_failed=%d expired=%d", self.folder,
                 self.ttl_s, self.pod or "-", len(self._jobs), restarted, expired)

    # -- jobs -----------------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"video_{self.pod}_{uuid.uuid4().hex}" if self.pod else f"video_{uuid.uuid4().hex}"

    def add(self, job: VideoJob) -> VideoJob:
        """Record a new queued job (persisted at once, so a restart can say what became of it)."""
        self._write_sidecar(job)
        self._jobs[job.id] = job
        self._evict_over_cap()
        return job

    def forget(self, video_id: str) -> None:
        """Remove a job that never ran (the queue refused it) and its record."""
        self._drop(video_id)

    def owner(self, video_id: str) -> str | None:
        """The other pod a job id names, or None when the job is this pod's (or names no pod)."""
        pod = pod_of(video_id)
        return pod if pod is not None and pod != self.pod else None

    def get(self, video_id: str) -> VideoJob:
        """This pod's job; `VideoElsewhere` when the id names another pod, `VideoNotFound` otherwise."""
        self.sweep()
        other = self.owner(video_id)
        if other is not None:
            raise VideoElsewhere(other, video_id)
        job = self._jobs.get(video_id)
        if job is None:
            raise VideoNotFound(f"no video job {video_id!r}")
        return job

    def content_path(self, video_id: str) -> Path:
        """The MP4 of a completed job (`VideoNotReady` before that)."""
        job = self.get(video_id)
        if job.status != "completed":
            raise VideoNotReady(f"video {video_id} is {job.status}; content is available once it is completed",
                                failed=job.status == "failed")
        return self._mp4(job.id)

    def list(self, *, limit: int = 20, after: str | None = None,
             order: Literal["asc", "desc"] = "desc") -> tuple[list[VideoJob], bool]:
        """This pod's jobs by creation time, a page of `limit` after the job `after`; and whether
        more follow."""
        self.sweep()
        jobs = sorted(self._jobs.values(), key=lambda j: (j.created_at, j.id), reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise VideoNotFound(f"after={after!r} is not a video job of this server", param="after")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    def delete(self, video_id: str) -> VideoJob:
        """Remove a finished job and its files; a queued or running job is refused (`VideoNotFinished`)."""
        job = self.get(video_id)
        if job.status not in FINISHED:
            raise VideoNotFinished(f"video {video_id} is {job.status}; delete it once it is completed or failed")
        self._drop(job.id)
        return job

    def start(self, video_id: str, rank: int) -> None:
        job = self._jobs.get(video_id)
        if job is not None and job.status == "queued":
            job.status, job.rank = "in_progress", rank

    def write_content(self, video_id: str, mp4: bytes) -> None:
        """Write a job's MP4 (any thread: no store state changes here)."""
        _write_atomically(self._mp4(video_id), mp4)

    def complete(self, video_id: str) -> None:
        """Mark a job completed once `write_content` wrote its MP4 (in the event loop)."""
        job = self._jobs.get(video_id)
        if job is None:  # evicted meanwhile
            self._mp4(video_id).unlink(missing_ok=True)
            return
        self._finish(job, "completed", int(self.clock()))

    def fail(self, video_id: str, code: str, message: str) -> None:
        job = self._jobs.get(video_id)
        if job is not None:
            self._finish(job, "failed", int(self.clock()), error={"code": code, "message": message})

    def sweep(self) -> int:
        """Drop expired jobs and their files; the number dropped."""
        now = self.clock()
        expired = [j.id for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]
        for video_id in expired:
            self._drop(video_id)
        if expired:
            log.info("video store: %d job(s) expired", len(expired))
        return len(expired)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, video_id: object) -> bool:
        return video_id in self._jobs

    # -- private --------------------------------------------------------------------------------------
    def _finish(self, job: VideoJob, status: VideoStatus, now: int, error: dict[str, str] | None = None) -> None:
        job.status, job.completed_at, job.error = status, now, error
        job.expires_at = now + int(self.ttl_s)
        try:
            if status == "failed":
                self._mp4(job.id).unlink(missing_ok=True)
            self._write_sidecar(job)
        except OSError as e:  # the job's state here is right; after a restart it would read as interrupted
            log.error("video store: could not record %s as %s: %s", job.id, status, e)

    def _evict_over_cap(self) -> None:
        """Beyond `max_jobs`, the oldest finished jobs go first (running ones are never evicted)."""
        over = len(self._jobs) - self.max_jobs
        if over <= 0:
            return
        for job in [j for j in self._jobs.values() if j.status in FINISHED][:over]:
            self._drop(job.id)

    def _drop(self, video_id: str) -> None:
        self._jobs.pop(video_id, None)
        self._remove_files(video_id)

    def _remove_files(self, video_id: str) -> None:
        for path in (self._mp4(video_id), self.folder / f"{video_id}.json"):
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("video store: could not remove %s: %s", path, e)

    def _mp4(self, video_id: str) -> Path:
        return self.folder / f"{video_id}.mp4"

    def _write_sidecar(self, job: VideoJob) -> None:
        _write_atomically(self.folder / f"{job.id}.json", json.dumps(job.sidecar(), sort_keys=True).encode())
