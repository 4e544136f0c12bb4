"""A video job's record on disk: ids, the `VideoJob` and its sidecar, durable writes and removals.

Owns: job ids (`video_<pod>_<hex>` when the pod is named, so any pod can tell whose a job is, and
`pod_of`), `VideoJob` and its sidecar format (`<id>.json`, version 1; `client` and `tenant` are
optional, absent in older sidecars: a job without a tenant is an admin's to see), and the file operations every store change goes through: `write_atomically`
(temp file + fsync + rename + fsync of the folder: a reader or a restart sees the old file or the
new one, never half of one, and a rename survives a power cut) and `remove_durably` (unlink, then
fsync of the folder; an error is raised, never swallowed, so a delete that did not happen is never
answered as done); and the folder's safety: `private_folder` (made with mode 0700, refused when
it is a link, another user's or open to others: the default folder outside a pod), `read_record`
(through `dlo.engine.checkpoint.open_regular`: never through a symbolic link, never anything but a
regular file, at most `MAX_RECORD_BYTES`) and `regular_file`.
Must never: trust a file name it did not make (ids are checked before they touch a folder), follow
a link planted in the folder, or speak HTTP.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from dlo.cli.args import DNS_LABEL
from dlo.engine.checkpoint import open_regular

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
FINISHED = ("completed", "failed")
SIDECAR_VERSION = 1
MAX_RECORD_BYTES = 1 << 20  # a record is a few hundred bytes (a prompt of at most a few KB)
# Pod names are DNS labels (RFC 1123): never an underscore, so the id splits unambiguously.
POD = re.compile(DNS_LABEL)
ID = re.compile(r"^video_(?:(?P<pod>[a-z0-9][-a-z0-9]{0,62})_)?(?P<hex>[0-9a-f]{32})$")


def pod_of(video_id: str) -> str | None:
    """The pod a job id names (None for an unnamed id or one that is not ours to parse)."""
    m = ID.match(video_id)
    return m.group("pod") if m else None


@dataclass
class VideoJob:
    """One job. `steps` sizes its progress; `rank` is the rank running it once its wave started;
    `tenant` is the name of the key that created it (None: no key, or recorded before tenants):
    who may see it (`dlo.serving.tenants.Caller.sees`); `client` is whom its quota counts it against
    (that tenant, or without named keys the client's address)."""

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
    tenant: str | None = None
    vae_tiled: bool | None = None  # its decode runs tiled (not a plain decode's bytes: --vae-tiling)
    phase_seconds: dict[str, float] | None = None  # once completed: its rank's seconds per phase
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
        return cls(**fields, client=data.get("client"), tenant=data.get("tenant"), vae_tiled=data.get("vae_tiled"),
                   phase_seconds=data.get("phase_seconds"))


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


def private_folder(path: Path) -> Path:
    """`path` as a folder only this user reaches: made with mode 0700 when absent; ValueError naming
    it when it is a link or not a folder, belongs to another user, or others may enter it."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path} is not a folder (a link or a file): remove it, or pass --video-dir")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path} belongs to user {st.st_uid}, not to this server's user {os.geteuid()}: whoever "
                         "owns it could plant video records there; remove it, or pass --video-dir")
    if st.st_mode & 0o077:
        raise ValueError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: other users may reach it; "
                         f"chmod 700 {path}, or pass --video-dir")
    return path


def read_record(path: Path) -> bytes:
    """A record's bytes, never through a link nor from anything but a regular file (OSError), nor past
    `MAX_RECORD_BYTES` (ValueError)."""
    with open_regular(path, follow_links=False) as f:
        data = f.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"{path} is larger than a video record may be ({MAX_RECORD_BYTES} bytes)")
    return data


def regular_file(path: Path) -> bool:
    """Whether `path` itself (not what a link names) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
