"""The Hugging Face Hub through huggingface_hub: a repo revision resolved from the local cache when it
is there (no network), else listed and downloaded with `snapshot_download`; every file verified.

Owns: `HFSource`. The library reads HF_TOKEN, HF_ENDPOINT (or `endpoint`), HF_HOME / HF_HUB_CACHE and
HF_HUB_OFFLINE itself. Checksums: a cached file is a link to a blob named by its checksum (SHA-256
for LFS files, the git blob SHA-1 for the others), a listed file carries both in its metadata; each
staged file is hashed and compared. Files from the cache are hard-linked into the staging folder
where the file system allows (no second copy), else copied.
The library's download runs under the fetch's `Guard` (its deadline and stall bound: bytes counted
as they land in the staging folder).
Must never: take a folder the local cache's `refs/` file names as a snapshot unless it is a commit
folder of the repo's own `snapshots/`, download outside `snapshot_download` (its resumable transfer and auth are the
library's), or publish a file whose hash differs from the one the cache or the Hub vouches for.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

from dlo.delivery.deadline import Guard
from dlo.delivery.errors import FetchError, SourceRefused
from dlo.delivery.paths import path_under
from dlo.delivery.pipeline import SourceFile
from dlo.delivery.progress import Progress
from dlo.delivery.staging import Staging
from dlo.delivery.uri import ModelURI

DEFAULT_CONCURRENCY = 8
_CHUNK = 8 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _translate(e: Exception, where: str) -> FetchError:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return FetchError("auth", f"{where}: the repository is gated: accept its terms and set HF_TOKEN "
                          "(in Kubernetes: a Secret named in spec.model.secretRef)")
    if isinstance(e, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
        return FetchError("not_found", f"{where}: {type(e).__name__}: no such repository or revision (or it is "
                          "private: set HF_TOKEN)")
    if isinstance(e, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)):
        return FetchError("not_found", f"{where}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set "
                          "(or the Hub is unreachable)")
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return FetchError("auth", f"{where}: the Hub refused the token (HTTP {status}); check HF_TOKEN")
        return FetchError("transfer", f"{where}: {e}")
    if isinstance(e, OSError):
        return FetchError("transfer", f"{where}: {e}")
    raise e


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % path.stat().st_size)
    _feed(h, path)
    return h.hexdigest()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    _feed(h, path)
    return h.hexdigest()


def _feed(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


class HFSource:
    """One `hf://org/name@revision` model."""

    def __init__(self, uri: ModelURI, endpoint: str | None = None, concurrency: int = DEFAULT_CONCURRENCY,
                 cache_dir: Path | None = None, guard: Guard | None = None) -> None:
        self.uri, self.endpoint, self.concurrency, self.cache_dir = uri, endpoint, concurrency, cache_dir
        self.guard = guard or Guard(float("inf"), 0, float("inf"), lambda: 0)
        self.snapshot: Path | None = None  # the cached snapshot folder, when the cache holds the revision
        self.commit: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"uri": str(self.uri), "endpoint": self.endpoint, "revision": self.commit}

    def cached_snapshot(self) -> Path | None:
        """The snapshot folder of this revision in the local cache, found with no network call."""
        from huggingface_hub import errors, snapshot_download

        try:
            path = snapshot_download(self.uri.path, revision=self.uri.revision, cache_dir=self.cache_dir,
                                     local_files_only=True)
        except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, errors.IncompleteSnapshotError,
                FileNotFoundError):
            return None
        return self._own_snapshot(Path(str(path)))

    def _own_snapshot(self, path: Path) -> Path:
        """`path` when it is a commit folder of this repo's own `snapshots/` in the cache; else
        SourceRefused (the library read the folder's name from the local `refs/<revision>` file, which
        may hold any path)."""
        from huggingface_hub import constants

        root = Path(self.cache_dir or constants.HF_HUB_CACHE)
        snapshots = root / f"models--{self.uri.path.replace('/', '--')}" / "snapshots"
        if path.parent != snapshots or not _COMMIT.fullmatch(path.name) or path.is_symlink():
            raise SourceRefused(f"{self.uri}: the local Hugging Face cache resolves revision {self.uri.revision!r} to "
                                f"{str(path)[:200]!r}, not a commit folder of {snapshots}: its refs/ file holds a path; "
                                "remove it, or fetch another revision", reason="invalid")
        return path

    def listing(self) -> list[SourceFile]:
        self.snapshot = self.cached_snapshot()
        if self.snapshot is not None:
            self.commit = self.snapshot.name
            return _cached_files(self.snapshot)
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint).model_info(self.uri.path, revision=self.uri.revision,
                                                            files_metadata=True)
        except Exception as e:  # noqa: BLE001 (_translate re-raises what is not the library's)
            raise _translate(e, str(self.uri)) from None
        self.commit = info.sha
        out = []
        for s in info.siblings or []:
            lfs = getattr(s, "lfs", None)
            if lfs is not None:
                out.append(SourceFile(s.rfilename, int(lfs.size), lfs.sha256, "sha256"))
            else:
                out.append(SourceFile(s.rfilename, int(s.size or 0), s.blob_id or "", "git-sha1"))
        return sorted(out, key=lambda f: f.path)

    def download(self, staging: Staging, files: list[SourceFile], progress: Progress) -> None:
        todo = [f for f in files if not staging.verified(f)]
        if self.snapshot is not None:
            for f in todo:
                _link_or_copy(path_under(self.snapshot, f.path), staging.path(f.path))
                progress.advance(f.size)
        elif todo:
            self._snapshot_download(staging, todo, progress)
        for f in todo:
            if not self.verify(staging.path(f.path), f):
                raise FetchError("verify", f"{self.uri}: {f.path} does not match its {f.kind} {f.checksum}; remove "
                                 "the cache entry or the staging folder and fetch again")
            staging.mark_verified(f)
            progress.file_done()

    def _snapshot_download(self, staging: Staging, files: list[SourceFile], progress: Progress) -> None:
        from huggingface_hub import snapshot_download

        stop = threading.Event()
        watcher = threading.Thread(target=_watch_bytes, args=(staging.root, progress, stop), daemon=True)
        watcher.start()

        def download(_: threading.Event) -> None:  # the library's own threads: bounded by the Guard's wait
            try:
                snapshot_download(self.uri.path, revision=self.commit, local_dir=staging.root,
                                  endpoint=self.endpoint, allow_patterns=[f.path for f in files],
                                  max_workers=self.concurrency)
            except Exception as e:  # noqa: BLE001
                raise _translate(e, str(self.uri)) from None

        try:
            self.guard.parallel([download], 1)
        finally:
            stop.set()
            watcher.join()
        shutil.rmtree(staging.root / ".cache", ignore_errors=True)  # the library's resume metadata

    @staticmethod
    def verify(path: Path, f: SourceFile) -> bool:
        if not path.is_file() or path.stat().st_size != f.size:
            return False
        if f.kind == "sha256":
            return sha256(path) == f.checksum
        return git_blob_sha1(path) == f.checksum


def _cached_files(snapshot: Path) -> list[SourceFile]:
    """The files of a cached snapshot: each a link into `blobs/`, the blob named by its checksum."""
    out = []
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        blob = path.resolve().name
        kind = "sha256" if len(blob) == 64 else "git-sha1"
        out.append(SourceFile(path.relative_to(snapshot).as_posix(), path.stat().st_size, blob, kind))
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)


def _watch_bytes(root: Path, progress: Progress, stop: threading.Event) -> None:
    """Count the bytes landing under `root` (the library writes them; its own bar is per file)."""
    seen = 0
    while not stop.wait(1.0):
        now = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith(".dlo-"))
        if now > seen:
            progress.advance(now - seen)
            seen = now
