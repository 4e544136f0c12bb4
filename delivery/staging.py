"""The staging folder beside DEST where a fetch lands, its resume state, the lock that keeps one
fetch at a time on DEST, and the atomic publish.

Owns: `Staging` (`.<name>.partial` beside DEST on the same filesystem, so the publish is one
rename; made with the marker of `dlo.delivery.owned`, so a later fetch resumes it when it is for
the same source and reclaims it when it is not, and refuses a folder of that name it did not make;
per file the parts already written and whether the file was verified, kept in `.dlo-state.json` and
flushed as parts complete, so a killed fetch resumes where it stopped; every file path through
`dlo.delivery.paths.path_under`, the listing's names all checked before the folder is made),
`dest_lock` (an flock on `.<name>.lock` beside DEST, waited for with a deadline), the manifest a
published folder carries (`.dlo-fetch.json`: the source, its revision and every file's size and
checksum), and `published_manifest`.
Must never: put anything at DEST before every file is verified, trust a state written for another
source or another version of a file, or remove a folder it did not make.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlo.delivery.errors import FetchError
from dlo.delivery.owned import MARKER, NotMarked, make_marked, marker_of, remove_marked, take_over
from dlo.delivery.paths import path_under
from dlo.delivery.pipeline import SourceFile

log = logging.getLogger(__name__)

STATE = ".dlo-state.json"
MANIFEST = ".dlo-fetch.json"
FLUSH_INTERVAL_S = 0.5
MAKER = "dlo fetch"
LOCK_POLL_S = 0.2


def staging_dir(dest: Path) -> Path:
    """Where a fetch into `dest` lands first: a hidden folder beside it (readers skip dot folders)."""
    return dest.parent / f".{dest.name}.partial"


def lock_path(dest: Path) -> Path:
    """The file a fetch into `dest` holds an flock on (beside it: DEST itself appears only at the end)."""
    return dest.parent / f".{dest.name}.lock"


@contextlib.contextmanager
def dest_lock(dest: Path, wait_s: float) -> Iterator[None]:
    """Hold the lock of `dest` (one fetch at a time writes it); wait at most `wait_s` seconds for a
    fetch that holds it, then FetchError. The kernel drops the lock when its holder dies; the lock
    file is removed by the fetch that created it, while it still holds it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(dest)
    deadline = time.monotonic() + wait_s
    fd, created = _acquire(path)
    while fd is None:
        if time.monotonic() >= deadline:
            raise FetchError("invalid", f"another fetch is writing {dest} (it holds {path}); waited {wait_s:g} s "
                             "for it: run again when it has ended")
        log.info("waiting for another fetch into dest=%s", dest)
        time.sleep(LOCK_POLL_S)
        fd, created = _acquire(path)
    try:
        yield
    finally:
        if created:
            path.unlink(missing_ok=True)  # still held: a waiter finds its file gone and makes a new one
        os.close(fd)


def _acquire(path: Path) -> tuple[int | None, bool]:
    """(the descriptor of `path` locked by us, whether we created it), or (None, False) while
    another holds it. A file removed or replaced after we opened it is not the lock: opened again."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, flags), False
            except FileNotFoundError:
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None, False
        try:
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                return fd, created
        except FileNotFoundError:
            pass
        os.close(fd)


def published_manifest(dest: Path) -> dict[str, Any] | None:
    """The manifest of a folder `dlo fetch` published, or None when `dest` holds none."""
    try:
        data = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


class Staging:
    """The staging folder of one fetch. Thread-safe: parts complete on worker threads."""

    def __init__(self, dest: Path, source: str, names: list[str]) -> None:
        """The staging folder of a fetch of `source` whose files are `names` (each checked, and
        against the others, before anything is made): resumed when an earlier fetch of the same
        source left it, else made anew. Call with `dest_lock` held."""
        self.dest = dest
        self.root = staging_dir(dest)
        self.source = source
        self._lock = threading.Lock()
        self._flushed = 0.0
        self._files: dict[str, dict[str, Any]] = {}
        self._mapped: dict[str, str] = {}
        for name in names:
            path_under(self.root, name, self._mapped)
        try:
            self._open()
        except NotMarked as e:
            raise FetchError("invalid", str(e)) from None
        except OSError as e:
            raise FetchError("invalid", f"cannot create {self.root} ({e.strerror}): is {dest.parent} writable?") from None

    def _open(self) -> None:
        """Resume our folder of the same source; reclaim ours of another (a failed fetch's); refuse
        one we did not make."""
        state = self._read_state()
        if marker_of(self.root) is None and isinstance(state.get("source"), str) and not self.root.is_symlink():
            (self.root / MARKER).write_text(json.dumps({"made_by": MAKER, "adopted": True}))  # an older dlo's
        found = marker_of(self.root)
        if found is not None and found["made_by"] == MAKER and state.get("source") == self.source:
            take_over(self.root, found)  # this run, not the one that died, is at work here now
            self._files = dict(state.get("files") or {})
            return
        if self.root.exists() or self.root.is_symlink():
            remove_marked(self.root, MAKER)
            log.info("reclaimed the staging folder of an earlier fetch path=%s", self.root)
        make_marked(self.root, MAKER, dest=str(self.dest))

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.root / STATE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def path(self, rel: str) -> Path:
        """Where the listed file `rel` is staged (`path_under`: never outside the folder)."""
        return path_under(self.root, rel, self._mapped)

    def begin(self, file: SourceFile, part_size: int) -> set[int]:
        """Parts of `file` already written by an earlier run, when it wrote the same version with
        the same part size and its data file is still there; else a fresh, preallocated file."""
        with self._lock:
            entry = self._files.get(file.path)
            data = self.path(file.path)
            same = (entry is not None and entry.get("checksum") == file.checksum and entry.get("size") == file.size
                    and entry.get("part_size") == part_size and data.is_file() and data.stat().st_size == file.size)
            if same:
                return set(entry["done"])  # type: ignore[index]
            data.parent.mkdir(parents=True, exist_ok=True)
            with open(data, "wb") as f:
                f.truncate(file.size)
            self._files[file.path] = {"checksum": file.checksum, "size": file.size, "part_size": part_size,
                                      "done": [], "verified": False}
        self.flush(force=True)
        return set()

    def part_done(self, file: SourceFile, index: int) -> None:
        with self._lock:
            self._files[file.path]["done"].append(index)
        self.flush()

    def verified(self, file: SourceFile) -> bool:
        entry = self._files.get(file.path) or {}
        return bool(entry.get("verified")) and entry.get("checksum") == file.checksum

    def mark_verified(self, file: SourceFile) -> None:
        """`file` is staged and matches its checksum (also for files a library wrote itself)."""
        with self._lock:
            entry = self._files.setdefault(file.path, {"checksum": file.checksum, "size": file.size,
                                                       "part_size": 0, "done": []})
            entry["verified"] = True
        self.flush(force=True)

    def restart(self, file: SourceFile) -> None:
        """Forget `file` (it failed its check): the next `begin` writes it again."""
        with self._lock:
            self._files.pop(file.path, None)
        self.flush(force=True)

    def done_bytes(self, files: list[SourceFile]) -> int:
        """Bytes of `files` already written (what a resumed fetch need not download)."""
        total = 0
        for f in files:
            entry = self._files.get(f.path)
            if entry and entry.get("checksum") == f.checksum:
                size, part = f.size, int(entry["part_size"]) or 1
                total += sum(min(part, size - i * part) for i in set(entry["done"]))
        return total

    def flush(self, force: bool = False) -> None:
        """Write the resume state (at most every FLUSH_INTERVAL_S unless `force`), atomically."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._flushed < FLUSH_INTERVAL_S:
                return
            self._flushed = now
            text = json.dumps({"source": self.source, "files": self._files})
            tmp = self.root / f"{STATE}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.root / STATE)

    def discard(self) -> None:
        remove_marked(self.root, MAKER)

    def publish(self, files: list[SourceFile], source: dict[str, Any]) -> None:
        """Write the manifest and rename the staging folder to DEST (one rename: DEST appears whole)."""
        manifest = {
            "version": 1, **source,
            "bytes": sum(f.size for f in files),
            "files": {f.path: f.to_json() for f in files},
            "published_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (self.root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        listed = {self.path(f.path) for f in files} | {self.root / MANIFEST, self.root / MARKER}
        for path in sorted(self.root.rglob("*"), reverse=True):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()  # folders a library left empty (e.g. a download cache)
            elif not path.is_dir() and path not in listed:
                path.unlink()  # the state, or a file of an earlier listing of this source
        os.sync()  # the files are on disk before the folder's name says they are complete
        try:
            os.rename(self.root, self.dest)
        except OSError as e:
            raise FetchError("invalid", f"cannot publish {self.root} as {self.dest} ({e.strerror})") from None
        (self.dest / MARKER).unlink(missing_ok=True)  # a published folder is known by its manifest
