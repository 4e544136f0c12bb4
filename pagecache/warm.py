"""The page-cache warmer behind `dlo warm` (and the agent's `--warm`).

Owns: bringing model files into the OS page cache before an engine maps them: each safetensors
file is mapped read-only, advised `WILLNEED` (mapping and file), then read in parallel chunks by a
thread pool (`os.preadv` releases the GIL, so N threads keep N requests in flight), and finally
measured with `dlo.pagecache.residency`. With `lock=True` the mappings are also `mlock`ed, which keeps
the pages resident for as long as the returned `WarmSession` stays open.
Must never: write to the files, or import torch.

Which cgroup pays (measured on a cgroup-v1 host, see docs/agent.md): a page-cache page is charged
to the memory cgroup of the process that first faulted it in, and stays charged there while it is
cached, whoever maps it later. An init container that warms therefore charges the model's page
cache to the engine pod (init containers share the pod cgroup); an agent that warms charges it to
the agent's pod, and the engine pod's cgroup then shows the mapping but not its pages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dlo.pagecache.residency import Mapping, Residency, file_residency, model_files

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20  # one pread
READ_BYTES = CHUNK_BYTES * 4  # one thread's job: a file's range read in chunks


@dataclass
class WarmSession:
    """The outcome of a warm; holds locked mappings open until `close()` when `lock=True`."""

    before: Residency
    after: Residency
    seconds: float
    threshold: float
    mappings: list[Mapping] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every file is at least `threshold` resident."""
        return self.after.min_ratio >= self.threshold

    def report(self) -> dict:
        """The `dlo warm --json` document."""
        before = {f.path: f for f in self.before.files}
        return {
            "ok": self.ok,
            "threshold": self.threshold,
            "seconds": round(self.seconds, 3),
            "bytes": self.after.bytes,
            "resident_bytes": self.after.resident_bytes,
            "ratio": self.after.ratio,
            "locked": bool(self.mappings),
            "files": [
                {
                    "path": f.path,
                    "bytes": f.bytes,
                    "resident_bytes": f.resident_bytes,
                    "ratio": f.ratio,
                    "ratio_before": before[f.path].ratio if f.path in before else None,
                    "method": f.method,
                }
                for f in self.after.files
            ],
        }

    def close(self) -> None:
        for m in self.mappings:
            m.close()
        self.mappings.clear()


def _touch(path: Path, start: int, length: int, progress: Callable[[int], None] | None) -> None:
    buf = bytearray(min(length, CHUNK_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        off, end = start, start + length
        while off < end:
            view = memoryview(buf)[: min(len(buf), end - off)]
            n = os.preadv(fd, [view], off)
            if n <= 0:
                break  # the file shrank under us; residency will tell
            off += n
            if progress is not None:
                progress(n)
    finally:
        os.close(fd)


def _advise_willneed(m: Mapping, f: Path) -> None:
    m.advise_willneed()
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def read_range(path: Path, start: int, length: int) -> int:
    """Read `length` bytes of `path` from `start` into the page cache (`length`; 0 for a file that
    went away)."""
    try:
        _touch(path, start, length, None)
    except FileNotFoundError:
        return 0
    return length


def warm(
    paths: list[Path | str],
    *,
    threads: int | None = None,
    threshold: float = 0.99,
    lock: bool = False,
    advise: bool = True,
    progress: Callable[[int], None] | None = None,
) -> WarmSession:
    """Warm every safetensors file under `paths`; `progress(n)` is called with bytes read. `advise`:
    advise the kernel to read each file whole ahead (`WILLNEED`) before the threads read it (off
    where other reads share the disk: the advice queues every file in front of them)."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold is a ratio 0..1 (got {threshold})")
    files: list[Path] = []
    for p in paths:
        found = model_files(p)
        if not found:
            raise FileNotFoundError(f"{p}: no *.safetensors files to warm")
        files.extend(found)
    before = Residency([file_residency(f) for f in files])
    workers = threads or min(32, (os.cpu_count() or 1) * 4)
    lock_guard = threading.Lock()

    def tick(n: int) -> None:
        if progress is not None:
            with lock_guard:
                progress(n)

    t0 = time.monotonic()
    mappings: list[Mapping] = []
    try:
        for f in files:
            m = Mapping(f)
            if advise:
                _advise_willneed(m, f)
            mappings.append(m)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlo-warm") as pool:
            jobs = [
                pool.submit(_touch, m.path, off, min(READ_BYTES, m.size - off), tick)
                for m in mappings
                for off in range(0, m.size, READ_BYTES)
            ]
            for j in jobs:
                j.result()
        if lock:
            for m in mappings:
                m.lock()
        seconds = time.monotonic() - t0
        after = Residency([file_residency(f) for f in files])
    except BaseException:
        for m in mappings:
            m.close()
        raise
    if not lock:
        for m in mappings:
            m.close()
        mappings = []
    log.info(
        "warmed files=%d bytes=%d seconds=%.2f ratio=%.4f locked=%s",
        len(files), after.bytes, seconds, after.ratio, lock,
    )
    return WarmSession(before, after, seconds, threshold, mappings)

