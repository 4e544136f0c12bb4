"""A node's model cache: the folders `dlo fetch` published under one root, when each was last
served, and eviction (least recently served first) to fit a disk budget and the free space.

Owns: `cached_models`, `touch_served`, `make_room`. A folder without the fetch manifest (a model
someone copied by hand) is never counted or evicted; neither is one named in `keep` (a pod on the
node uses it) nor the destination itself.
Must never: delete a folder in place (it is renamed to a hidden name first, so no reader sees a
half-deleted model), or evict to make room for less than the fetch still needs.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dlo.delivery.errors import FetchError
from dlo.delivery.staging import MANIFEST, published_manifest

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


def make_room(root: Path, dest: Path, total: int, remaining: int, budget: int | None,
              keep: set[str]) -> list[str]:
    """Evict least recently served models under `root` until the cache (with `total` bytes for
    `dest`) fits `budget` and the disk has `remaining` bytes (what is still to download) free.
    Returns the evicted keys; raises FetchError `disk_budget` or `disk_full` when evicting every
    model not in use is not enough (nothing is evicted then)."""
    models = [m for m in cached_models(root) if m.path != dest]
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
    for m in chosen:
        _evict(m)
    return [m.key for m in chosen]


def _evict(model: CachedModel) -> None:
    doomed = model.path.parent / f".{model.key}.evicting-{os.getpid()}-{int(time.time())}"
    os.rename(model.path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    log.info("evicted model key=%s bytes=%d last_served=%s", model.key, model.bytes,
             time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(model.last_served)))
