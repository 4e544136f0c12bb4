"""A node's model cache: the folders `dlo fetch` published under one root, when each was last
served, which are in use, and eviction (least recently served first) to fit a disk budget and the
free space.

Owns: `cached_models`, `touch_served`, `make_room`, the serving lease (`hold_lease`: a shared flock
on the model folder itself, held by `dlo serve URI` for as long as it runs; eviction takes the
exclusive one, so a leased folder is never evicted and a folder being evicted is never leased),
`in_use` (the lease, or a live process of this host with a file of the folder mapped: a server
started on the folder's path) and `reclaim_stale_staging` (the staging folders of failed fetches
into other DESTs of the root, once their maker is gone and nobody holds their DEST's lock). A
folder without the fetch manifest (a model someone copied by hand) is never counted or evicted;
neither is one named in `keep` (a pod on the node uses it), one in use, nor the destination itself.
Must never: delete a folder in place (it is renamed to a hidden name first, so no reader sees a
half-deleted model), evict to make room for less than the fetch still needs, or remove a staging
folder it cannot prove abandoned (`dlo.delivery.owned`'s marker, its maker gone, its lock free).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dlo.delivery.errors import FetchError
from dlo.delivery.owned import NotMarked, maker_alive, marker_of, remove_marked
from dlo.delivery.staging import MAKER, MANIFEST, STATE, dest_lock, published_manifest

PROC = Path("/proc")
LEASE_WAIT_S = 5.0  # an eviction holds the exclusive lock for a rename and a removal
STALE_STAGING_S = 3600.0  # a failed fetch's staging folder untouched this long may be reclaimed
_LEASES: list[int] = []  # folders this process serves: their descriptors stay open (and locked) till exit

log = logging.getLogger(__name__)

SERVED = ".dlo-served"  # its mtime: when a fetch last saw the model in use, or published it
# Kept free beyond the model's bytes: file-system metadata, the resume state, logs.
FREE_RESERVE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class CachedModel:
    key: str
    path: Path
    bytes: int
    last_served: float


def cached_models(root: Path) -> list[CachedModel]:
    """Every folder directly under `root` that `dlo fetch` published, least recently served first."""
    out = []
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    for folder in folders:
        manifest = published_manifest(folder)
        if manifest is None:
            continue
        stamp = folder / SERVED
        served = stamp.stat().st_mtime if stamp.exists() else (folder / MANIFEST).stat().st_mtime
        out.append(CachedModel(folder.name, folder, int(manifest.get("bytes") or 0), served))
    return sorted(out, key=lambda m: (m.last_served, m.key))


def touch_served(folder: Path) -> None:
    """Record that `folder` is served now (a model in use, or one just published)."""
    try:
        (folder / SERVED).touch()
    except OSError as e:  # a read-only cache: the order falls back to the publish time
        log.warning("cannot stamp model as served path=%s error=%s", folder, e.strerror)


def _free_bytes(root: Path) -> int:
    return shutil.disk_usage(root).free


def hold_lease(folder: Path) -> None:
    """Hold the serving lease of `folder` until this process exits (FetchError when the folder was
    evicted or replaced meanwhile: run again)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise FetchError("invalid", f"{folder} is being evicted by another fetch: run again") from None
            time.sleep(0.05)
    try:
        same = os.stat(folder).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        raise FetchError("invalid", f"{folder} was evicted or replaced while it was being leased: run again")
    _LEASES.append(fd)


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[bool]:
    """The exclusive lock of `folder` while the block runs: True when taken (no lease held)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def in_use(folders: list[Path]) -> dict[Path, str]:
    """Which of `folders` are in use, and why: a server holds its lease, or a live process of this
    host maps one of its files (one pass over every /proc/PID/maps this process may read)."""
    busy: dict[Path, str] = {}
    for folder in folders:
        with _exclusive(folder) as free:
            if not free:
                busy[folder] = "a server holds its lease"
    prefixes = {f"{os.path.realpath(f)}/".encode(): f for f in folders if f not in busy}
    try:
        pids = [p for p in PROC.iterdir() if p.name.isdecimal()] if prefixes else []
    except OSError:
        pids = []
    for proc in pids:
        try:
            maps = (proc / "maps").read_bytes()
        except OSError:
            continue
        for prefix, folder in list(prefixes.items()):
            if prefix in maps and any(line.split(None, 5)[-1].startswith(prefix) for line in maps.splitlines()
                                      if prefix in line):
                busy[folder] = f"process {proc.name} maps its files"
                del prefixes[prefix]
    return busy


def reclaim_stale_staging(root: Path, now: float | None = None) -> list[Path]:
    """Remove the staging folders under `root` that a fetch made (its marker), whose maker is gone,
    whose DEST's lock nobody holds and that nothing wrote for `STALE_STAGING_S`; the folders
    removed. Any other `.NAME.partial` is left as it is."""
    now = time.time() if now is None else now
    removed = []
    try:
        folders = [p for p in root.iterdir() if p.name.startswith(".") and p.name.endswith(".partial")]
    except OSError:
        return []
    for folder in sorted(folders):
        found = marker_of(folder)
        if found is None or found.get("made_by") != MAKER or maker_alive(found):
            continue
        if now - _last_write(folder) < STALE_STAGING_S:
            continue
        dest = root / folder.name[1:].removesuffix(".partial")
        try:
            with dest_lock(dest, 0.0):
                remove_marked(folder, MAKER)
        except (FetchError, NotMarked, OSError) as e:
            log.info("staging folder left in place path=%s why=%s", folder, e)
            continue
        log.info("reclaimed the staging folder of an abandoned fetch path=%s", folder)
        removed.append(folder)
    return removed


def _last_write(folder: Path) -> float:
    times = []
    for path in (folder, folder / STATE):
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times, default=0.0)


def make_room(root: Path, dest: Path, total: int, remaining: int, budget: int | None,
              keep: set[str]) -> list[str]:
    """Evict least recently served models under `root` until the cache (with `total` bytes for
    `dest`) fits `budget` and the disk has `remaining` bytes (what is still to download) free.
    Returns the evicted keys; raises FetchError `disk_budget` or `disk_full` when evicting every
    model not in use is not enough (nothing is evicted then). A model in use (`in_use`) counts as
    one in `keep`."""
    models = [m for m in cached_models(root) if m.path != dest]
    busy = in_use([m.path for m in models if m.key not in keep])
    for m in models:
        if m.path in busy:
            log.info("not evicting a model in use key=%s why=%s", m.key, busy[m.path])
    keep = set(keep) | {m.key for m in models if m.path in busy}
    candidates = [m for m in models if m.key not in keep]
    used = sum(m.bytes for m in models)
    free = _free_bytes(root)
    chosen: list[CachedModel] = []
    for m in candidates:
        over_budget = budget is not None and used + total > budget
        if not over_budget and free >= remaining + FREE_RESERVE_BYTES:
            break
        chosen.append(m)
        used -= m.bytes
        free += m.bytes
    if budget is not None and used + total > budget:
        raise FetchError("disk_budget", f"the cache budget of {budget} bytes under {root} cannot hold {dest.name} "
                         f"({total} bytes): {used} bytes are models in use ({', '.join(sorted(keep)) or 'none'})")
    if free < remaining + FREE_RESERVE_BYTES:
        raise FetchError("disk_full", f"{root} has {free} bytes free (after evicting every model not in use) and "
                         f"{dest.name} needs {remaining + FREE_RESERVE_BYTES} more: free disk space or lower the "
                         "models this node holds")
    return [m.key for m in chosen if _evict(m)]


def _evict(model: CachedModel) -> bool:
    """Rename, then remove, `model`, holding its exclusive lock (False: it was leased meanwhile)."""
    with _exclusive(model.path) as free:
        if not free:
            log.info("not evicting a model leased meanwhile key=%s", model.key)
            return False
        doomed = model.path.parent / f".{model.key}.evicting-{os.getpid()}-{int(time.time())}"
        os.rename(model.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    log.info("evicted model key=%s bytes=%d last_served=%s", model.key, model.bytes,
             time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(model.last_served)))
    return True
