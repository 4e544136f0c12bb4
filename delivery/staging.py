"""The staging folder beside DEST where a fetch lands, its resume state, and the atomic publish.

Owns: `Staging` (`.<name>.partial` beside DEST on the same filesystem, so the publish is one
rename; per file the parts already written and whether the file was verified, kept in
`.dlo-state.json` and flushed as parts complete, so a killed fetch resumes where it stopped),
the manifest a published folder carries (`.dlo-fetch.json`: the source, its revision and every
file's size and checksum), and `published_manifest`.
Must never: put anything at DEST before every file is verified, or trust a state written for
another source or another version of a file.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from dlo.delivery.errors import FetchError
from dlo.delivery.pipeline import SourceFile

STATE = ".dlo-state.json"
MANIFEST = ".dlo-fetch.json"
FLUSH_INTERVAL_S = 0.5


def staging_dir(dest: Path) -> Path:
    """Where a fetch into `dest` lands first: a hidden folder beside it (readers skip dot folders)."""
    return dest.parent / f".{dest.name}.partial"


def published_manifest(dest: Path) -> dict[str, Any] | None:
    """The manifest of a folder `dlo fetch` published, or None when `dest` holds none."""
    try:
        data = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


class Staging:
    """The staging folder of one fetch. Thread-safe: parts complete on worker threads."""

    def __init__(self, dest: Path, source: str) -> None:
        self.dest = dest
        self.root = staging_dir(dest)
        self.source = source
        self._lock = threading.Lock()
        self._flushed = 0.0
        self._files: dict[str, dict[str, Any]] = {}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FetchError("invalid", f"cannot create {self.root} ({e.strerror}): is {dest.parent} writable?") from None
        state = self._read_state()
        if state.get("source") == source:
            self._files = dict(state.get("files") or {})

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.root / STATE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def path(self, rel: str) -> Path:
        return self.root / rel

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
        shutil.rmtree(self.root, ignore_errors=True)

    def publish(self, files: list[SourceFile], source: dict[str, Any]) -> None:
        """Write the manifest and rename the staging folder to DEST (one rename: DEST appears whole)."""
        manifest = {
            "version": 1, **source,
            "bytes": sum(f.size for f in files),
            "files": {f.path: f.to_json() for f in files},
            "published_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (self.root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for leftover in (STATE, f"{STATE}.tmp"):
            (self.root / leftover).unlink(missing_ok=True)
        for path in sorted(self.root.rglob("*"), reverse=True):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()  # folders a library left empty (e.g. a download cache)
        os.sync()  # the files are on disk before the folder's name says they are complete
        try:
            os.rename(self.root, self.dest)
        except OSError as e:
            raise FetchError("invalid", f"cannot publish {self.root} as {self.dest} ({e.strerror})") from None
