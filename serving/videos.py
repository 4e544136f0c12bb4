"""The video job store: every `/v1/videos` job of this pod, in memory and on disk.

Owns: the job records of this pod and their lifecycle (`queued -> in_progress -> completed |
failed`), listing with OpenAI's cursor (`limit`, `after`, `order`), deletion, who sees a job (every
read takes the request's `Caller`: a job another tenant's caller may not see is answered as one that
does not exist, `VideoNotFound`, the same words; a list holds only what the caller sees), expiry (`expires_at` =
finish + TTL, then the record and its MP4 go), the job cap, and persistence in the store's folder
(`dlo.serving.video_records`: one `<id>.json` sidecar per job plus `<id>.mp4` once it
completed, written atomically and removed durably). On start the store reloads the folder: this
pod's finished jobs come back until they expire, a job that was queued or running when the process
stopped comes back `failed` with code `server_restarted` - unless its MP4 is there (written whole,
then renamed: only the record of its completion was lost, to a full disk say), then it comes back
`completed`.
- A shared folder (`--video-dir` on a ReadWriteMany volume, every pod of a deployment the same):
  each pod reloads only the jobs its id names; a finished job of another pod is read from the
  folder (`get`, `content_path`, `delete`: from any pod, also after its pod is gone; a pod forgets a
  finished job whose record another pod deleted); an unfinished one is the other pod's to answer
  (`VideoElsewhere`: forwarded); expired records of any pod are swept.
- A folder that cannot be written (read-only): a warning at start, new jobs refused with
  `VideoStoreReadOnly`, deletes answered with `VideoStorageError`; finished jobs are still served.
- The cap: at most `max_jobs` jobs, `max_jobs_per_client` of one client (a job's `client`: its
  tenant with named keys, else its address); beyond, new jobs are refused (`VideoJobsFull`) -
  expired jobs are swept first, an unexpired one is never evicted.
- The default folder outside a pod (`default_video_dir`) is private: `<tmp>/dlo-<uid>/videos-PORT`,
  both made with mode 0700 and refused when another user owns them or others may reach them.
Must never: speak HTTP (refusals are domain errors of `dlo.serving.errors`), hold MP4 bytes
in memory after they are written, answer a delete that did not happen as done, touch another pod's
unfinished job, tell a caller whether a job it may not see exists, trust a file name it did not make (ids are checked, and every record and MP4 path
is `dlo.delivery.paths.path_under` the folder), or read or serve a record or MP4 through a link.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, Literal

from dlo.delivery.paths import path_under
from dlo.engine.checkpoint import open_regular

from dlo.serving.errors import (
    VideoElsewhere,
    VideoJobsFull,
    VideoNotFinished,
    VideoNotFound,
    VideoNotReady,
    VideoStorageError,
    VideoStoreReadOnly,
)
from dlo.serving.tenants import EVERYONE, Caller
from dlo.serving.video_records import (
    FINISHED,
    ID,
    POD,
    VideoJob,
    VideoStatus,
    pod_of,
    private_folder,
    read_record,
    regular_file,
    remove_durably,
    writable,
    write_atomically,
)

__all__ = ["VideoJob", "VideoStore", "VideoStatus", "pod_of", "default_video_dir"]

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0
MAX_VIDEO_JOBS = 256
MAX_JOBS_PER_CLIENT = 64


def default_video_dir(port: int) -> Path:
    """Outside a pod: one folder per port in this user's private folder under the system temp dir
    (`<tmp>/dlo-<uid>/videos-PORT`), so that a restart on the same port finds its jobs again, two
    servers on one host never share a folder, and no other user can plant a record or a link in it.
    Both are made with mode 0700; ValueError when either is a link, another user's or open to
    others."""
    base = private_folder(Path(tempfile.gettempdir()) / f"dlo-{os.geteuid()}")
    return private_folder(base / f"videos-{port}")


class VideoStore:
    """`store = VideoStore(folder, ttl_s=3600, pod="wan-0"); store.load()`, then create/get/list/delete."""

    def __init__(self, folder: Path | str, *, ttl_s: float = DEFAULT_TTL_S, pod: str | None = None,
                 max_jobs: int = MAX_VIDEO_JOBS, max_jobs_per_client: int = MAX_JOBS_PER_CLIENT,
                 clock: Callable[[], float] = time.time):
        if ttl_s <= 0:
            raise ValueError(f"the video TTL must be > 0 seconds, got {ttl_s:g}")
        if pod is not None and not POD.match(pod):
            raise ValueError(f"pod name {pod!r} is not a DNS label (lowercase letters, digits, '-')")
        self.folder, self.ttl_s, self.pod, self.clock = Path(folder), ttl_s, pod, clock
        self.max_jobs, self.max_jobs_per_client = max_jobs, max_jobs_per_client
        self.read_only: OSError | None = None  # why the folder cannot be written, when it cannot
        self._jobs: dict[str, VideoJob] = {}  # insertion order = creation order

    # -- start ----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Create the folder and reload this pod's jobs: finished ones come back until they expire;
        ones that were queued or running when the process stopped come back failed
        (`server_restarted`). A folder that cannot be written is served read-only, with a warning."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.read_only = writable(self.folder)
        if self.read_only is not None:
            log.warning("video store: folder=%s is read-only (%s): finished jobs are served, new video jobs are "
                        "refused and deletes fail until it is writable", self.folder,
                        self.read_only.strerror or self.read_only)
        for tmp in self.folder.glob(".*.tmp"):  # a write this pod's previous process did not finish
            if self._mine_or_nobodys(tmp.name[1:].split(".", 1)[0]):
                tmp.unlink(missing_ok=True)
        jobs = [job for job in (self._read(path) for path in self.folder.glob("video_*.json"))
                if job is not None and self._mine(job.id)]
        now = int(self.clock())
        restarted = 0
        for job in sorted(jobs, key=lambda j: (j.created_at, j.id)):
            if job.status not in FINISHED and regular_file(self._mp4(job.id)):
                # its MP4 is whole (written, then renamed): only the record of its completion was lost
                self._finish(job, "completed", int(os.lstat(self._mp4(job.id)).st_mtime))
                log.warning("video store: %s was recorded unfinished but its MP4 is there: completed", job.id)
            elif job.status not in FINISHED:
                restarted += 1
                self._finish(job, "failed", now, error={
                    "code": "server_restarted",
                    "message": "the server restarted while this job was queued or running; create it again"})
            elif job.status == "completed" and not regular_file(self._mp4(job.id)):
                self._finish(job, "failed", now, error={
                    "code": "content_lost", "message": "the video file of this job is gone; create it again"})
            self._jobs[job.id] = job
        expired = self.sweep()
        log.info("video store folder=%s ttl=%gs pod=%s reloaded=%d restarted_failed=%d expired=%d read_only=%s",
                 self.folder, self.ttl_s, self.pod or "-", len(self._jobs), restarted, expired,
                 self.read_only is not None)

    def _read(self, path: Path) -> VideoJob | None:
        """A sidecar's job; an unreadable one of this pod is removed (another pod's is left alone)."""
        try:
            job = VideoJob.from_sidecar(json.loads(read_record(path)))
            if job.id != path.stem or not ID.match(job.id):
                raise ValueError(f"the sidecar holds id {job.id!r}")
            return job
        except FileNotFoundError:  # another pod removed it meanwhile (a shared folder)
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            # this pod's, or nobody's (a name that is no job id); another pod's is that pod's to judge
            if self._mine_or_nobodys(path.stem) and self.read_only is None:
                log.warning("video store: ignoring and removing unreadable sidecar %s: %s", path, e)
                self._remove_files(path.stem)
            return None

    # -- jobs -----------------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"video_{self.pod}_{uuid.uuid4().hex}" if self.pod else f"video_{uuid.uuid4().hex}"

    def add(self, job: VideoJob) -> VideoJob:
        """Record a new queued job (persisted at once, so a restart can say what became of it);
        refused when the folder is read-only or the cap (total, or the job's client's) is reached."""
        if self.read_only is not None:
            raise VideoStoreReadOnly(f"the video folder {self.folder} cannot be written "
                                     f"({self.read_only.strerror or self.read_only}): this server takes no video jobs")
        self.sweep()  # an expired job never holds a place
        if len(self._jobs) >= self.max_jobs:
            raise VideoJobsFull(f"this server holds its maximum of {self.max_jobs} video jobs; retry once some "
                                f"expire (--video-ttl {self.ttl_s:g} s) or delete finished ones")
        held = sum(1 for j in self._jobs.values() if j.client == job.client)
        if job.client is not None and held >= self.max_jobs_per_client:
            who = "tenant" if job.tenant is not None and job.tenant == job.client else "client"
            raise VideoJobsFull(f"this {who} holds {held} video jobs, its maximum here (--max-video-jobs-per-tenant "
                                f"{self.max_jobs_per_client}); delete finished ones or retry once some expire")
        write_atomically(self._record(job.id), json.dumps(job.sidecar(), sort_keys=True).encode())
        self._jobs[job.id] = job
        return job

    def forget(self, video_id: str) -> None:
        """Remove a job that never ran (the queue refused it) and its record."""
        self._jobs.pop(video_id, None)
        self._remove_files(video_id)

    def owner(self, video_id: str) -> str | None:
        """The other pod a job id names, or None when the job is this pod's (or names no pod)."""
        pod = pod_of(video_id)
        return pod if pod is not None and pod != self.pod else None

    def get(self, video_id: str, caller: Caller = EVERYONE) -> VideoJob:
        """This pod's job, or another pod's finished one from the shared folder; `VideoElsewhere`
        for another pod's job not finished here (its pod judges the caller), `VideoNotFound` for a
        job there is not, or that `caller` may not see."""
        self.sweep()
        other = self.owner(video_id)
        if other is not None:
            job = self._shared(video_id)
            if job is None or job.status not in FINISHED:
                seen = job is not None and caller.sees(job.tenant)
                raise VideoElsewhere(other, video_id, recorded=seen)
        else:
            job = self._jobs.get(video_id)
        if job is None or not caller.sees(job.tenant):
            raise VideoNotFound(f"no video job {video_id!r}")
        return job

    def content_path(self, video_id: str, caller: Caller = EVERYONE) -> Path:
        """The MP4 of a completed job (`VideoNotReady` before that; `VideoNotFound` when the file is
        not a regular file: a link planted in the folder is never served). Open it with
        `open_content`, which never follows a link."""
        job = self.get(video_id, caller)
        if job.status != "completed":
            raise VideoNotReady(f"video {video_id} is {job.status}; content is available once it is completed",
                                failed=job.status == "failed")
        path = self._mp4(job.id)
        if not regular_file(path):
            log.error("video store: the MP4 of %s is not a regular file (a link?): refused", job.id)
            raise VideoNotFound(f"no video file for {video_id!r}")
        return path

    def open_content(self, video_id: str, caller: Caller = EVERYONE) -> BinaryIO:
        """The MP4 of a completed job, opened (never through a link; `VideoNotFound` when it is gone
        or not a regular file): what is opened streams whole even if the job expires meanwhile."""
        path = self.content_path(video_id, caller)
        try:
            return open_regular(path, follow_links=False)
        except OSError:
            raise VideoNotFound(f"no video file for {video_id!r}") from None

    def list(self, *, limit: int = 20, after: str | None = None, order: Literal["asc", "desc"] = "desc",
             caller: Caller = EVERYONE) -> tuple[list[VideoJob], bool]:
        """This pod's jobs `caller` sees by creation time, a page of `limit` after the job `after`;
        and whether more follow."""
        self.sweep()
        mine = (j for j in self._jobs.values() if caller.sees(j.tenant))
        jobs = sorted(mine, key=lambda j: (j.created_at, j.id), reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise VideoNotFound(f"after={after!r} is not a video job of this server", param="after")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    def delete(self, video_id: str, caller: Caller = EVERYONE) -> VideoJob:
        """Remove a finished job `caller` sees and its files, durably; a queued or running job is
        refused (`VideoNotFinished`), a folder that refuses the removal is a `VideoStorageError` (the
        job stays)."""
        job = self.get(video_id, caller)
        if job.status not in FINISHED:
            raise VideoNotFinished(f"video {video_id} is {job.status}; delete it once it is completed or failed")
        try:  # the record first: once it is gone the job is gone, whatever happens to the MP4
            remove_durably(self._record(job.id), self._mp4(job.id))
        except OSError as e:
            log.error("video store: could not delete %s: %s", job.id, e)
            raise VideoStorageError(f"the server could not delete video {job.id}: {e.strerror or e}; it is "
                                    "still there") from None
        self._jobs.pop(job.id, None)
        return job

    def start(self, video_id: str, rank: int) -> None:
        job = self._jobs.get(video_id)
        if job is not None and job.status == "queued":
            job.status, job.rank = "in_progress", rank

    def write_content(self, video_id: str, mp4: bytes) -> None:
        """Write a job's MP4 (any thread: no store state changes here)."""
        write_atomically(self._mp4(video_id), mp4)

    def complete(self, video_id: str, phase_seconds: dict[str, float] | None = None) -> VideoJob | None:
        """Mark a job completed once `write_content` wrote its MP4 (in the event loop), with its
        rank's seconds per phase."""
        job = self._jobs.get(video_id)
        if job is None:  # deleted meanwhile
            self._mp4(video_id).unlink(missing_ok=True)
            return None
        job.phase_seconds = {k: round(v, 4) for k, v in (phase_seconds or {}).items()} or None
        self._finish(job, "completed", int(self.clock()))
        return job

    def fail(self, video_id: str, code: str, message: str) -> VideoJob | None:
        job = self._jobs.get(video_id)
        if job is not None:
            self._finish(job, "failed", int(self.clock()), error={"code": code, "message": message})
        return job

    def sweep(self) -> int:
        """Drop this pod's expired jobs and their files, and finished ones another pod deleted from a
        shared folder (their record is gone); the number dropped."""
        now = self.clock()
        expired = [j.id for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]
        for video_id in expired:
            self._jobs.pop(video_id, None)
            self._remove_files(video_id)
        if expired:
            log.info("video store: %d job(s) expired", len(expired))
        for job in [j for j in self._jobs.values() if j.status in FINISHED]:
            if not (self._record(job.id)).exists():
                self._jobs.pop(job.id, None)
        return len(expired)

    def sweep_folder(self) -> int:
        """Remove the expired records of other pods from a shared folder (a pod that is gone cannot
        sweep its own); the number removed."""
        if self.read_only is not None:
            return 0
        now, removed = self.clock(), 0
        for path in self.folder.glob("video_*.json"):
            if self._mine(path.stem):
                continue
            job = self._read(path)
            if job is not None and job.expires_at is not None and job.expires_at <= now:
                self._remove_files(job.id)
                removed += 1
        return removed

    def by_status(self) -> dict[str, int]:
        """This pod's jobs per status (every status present, 0 when none)."""
        counts = dict.fromkeys(("queued", "in_progress", "completed", "failed"), 0)
        for job in self._jobs.values():
            counts[job.status] += 1
        return counts

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, video_id: object) -> bool:
        return video_id in self._jobs

    # -- private --------------------------------------------------------------------------------------
    def _mine(self, video_id: str) -> bool:
        return pod_of(video_id) == self.pod

    def _mine_or_nobodys(self, name: str) -> bool:
        """This pod's, or named like no job (a shared folder: another pod's files are that pod's)."""
        return self._mine(name) or not ID.match(name)

    def _shared(self, video_id: str) -> VideoJob | None:
        """Another pod's job as the shared folder has it (None when it holds none)."""
        if not ID.match(video_id):
            return None
        path = self._record(video_id)
        job = self._read(path) if path.exists() else None
        if job is not None and job.expires_at is not None and job.expires_at <= self.clock():
            return None
        return job

    def _finish(self, job: VideoJob, status: VideoStatus, now: int, error: dict[str, str] | None = None) -> None:
        job.status, job.completed_at, job.error = status, now, error
        job.expires_at = now + int(self.ttl_s)
        try:
            if status == "failed":
                self._mp4(job.id).unlink(missing_ok=True)
            write_atomically(self._record(job.id), json.dumps(job.sidecar(), sort_keys=True).encode())
        except OSError as e:  # the job's state here is right; after a restart it would read as interrupted
            log.error("video store: could not record %s as %s: %s", job.id, status, e)

    def _remove_files(self, video_id: str) -> None:
        try:
            remove_durably(self._record(video_id), self._mp4(video_id))
        except OSError as e:
            log.warning("video store: could not remove the files of %s: %s", video_id, e)

    def _mp4(self, video_id: str) -> Path:
        return path_under(self.folder, f"{video_id}.mp4")

    def _record(self, video_id: str) -> Path:
        return path_under(self.folder, f"{video_id}.json")
