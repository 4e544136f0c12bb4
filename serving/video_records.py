"""A video job's record on disk: ids, the `VideoJob` and its sidecar, durable writes and removals.

Owns: job ids (`video_<pod>_<hex>` when the pod is named, so any pod can tell whose a job is, and
`pod_of`), `VideoJob` and its sidecar format (`<id>.json`, version 1; `client` is optional, absent
in older sidecars), and the file operations every store change goes through: `write_atomically`
(temp file + fsync + rename + fsync of the folder: a reader or a restart sees the old file or the
new one, never half of one, and a rename survives a power cut) and `remove_durably` (unlink, then
fsync of the folder; an error is raised, never swallowed, so a delete that did not happen is never
answered as done).
Must never: trust a file name it did not make (ids are checked before they touch a folder), or
speak HTTP.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
FINISHED = ("completed", "failed")
SIDECAR_VERSION = 1
# Pod names are DNS labels (RFC 1123): never an underscore, so the id splits unambiguously.
POD = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ID = re.compile(r"^video_(?:(?P<pod>[a-z0-9][-a-z0-9]{0,62})_)?(?P<hex>[0-9a-f]{32})$")


def pod_of(video_id: str) -> str | None:
    """The pod a job id names (None for an unnamed id or one that is not ours to parse)."""
    m = ID.match(video_id)
    return m.group("pod") if m else None


@dataclass
class VideoJob:
    """One job. `steps` sizes its progress; `rank` is the rank running it once its wave started;
    `client` is who created it (its address: the per-client quota)."""

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
    client: str | None = None
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
        return cls(**fields, client=data.get("client"))


def sync_folder(folder: Path) -> None:
    """fsync a folder: the names created, renamed or removed in it are on disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, flush it to disk, rename it over `path`, then sync
    the folder (the rename itself is then durable too)."""
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
    sync_folder(path.parent)


def remove_durably(*paths: Path) -> None:
    """Remove `paths` in order (absent ones are fine) and sync their folder; the first OSError
    (a read-only folder, say) is raised with the files after it left in place."""
    for path in paths:
        path.unlink(missing_ok=True)
    if paths:
        sync_folder(paths[0].parent)


def writable(folder: Path) -> OSError | None:
    """Whether a file can be created in `folder` (None), or the error that says why not."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".dlo-write-check.", suffix=".tmp")
    except OSError as e:
        return e
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return None
