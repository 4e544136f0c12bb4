"""A memory cgroup of our own for one process tree: create it, start a command inside it, read its peak.

Owns: `MemoryGroup` (cgroup v1's memory controller, `memory.max_usage_in_bytes`, or cgroup v2's
`memory.peak`, as a child of the cgroup this process runs in; a limit protects the host from the
measured tree) and `evict_page_cache` (a folder's files dropped from the page cache with
`posix_fadvise(DONTNEED)`, so a start reads them cold and their pages are charged to the new group,
not to whoever wrote them). Page-cache pages are charged to the cgroup that faults them in: a
measurement over files already cached would miss them.
Must never: touch a cgroup it did not create, or write to /proc/sys (drop_caches is host-wide).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be created here (no controller, no permission, v2 without delegation)."""


def _own_path(version: int) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if version == 2 and hid == "0":
            return path
        if version == 1 and "memory" in controllers.split(","):
            return path
    raise CgroupUnavailable(f"/proc/self/cgroup names no {'unified' if version == 2 else 'memory'} cgroup")


class MemoryGroup:
    """A new memory cgroup under ours: `with MemoryGroup("name", limit) as g: g.popen(cmd); g.peak()`."""

    def __init__(self, name: str, limit_bytes: int):
        if (ROOT / "memory" / "memory.max_usage_in_bytes").exists() or (ROOT / "memory").is_dir():
            self.version = 1
            self.path = ROOT / "memory" / _own_path(1).lstrip("/") / name
            files = ("memory.max_usage_in_bytes", "memory.limit_in_bytes", "memory.usage_in_bytes")
        elif (ROOT / "cgroup.controllers").exists():
            self.version = 2
            self.path = ROOT / _own_path(2).lstrip("/") / name
            files = ("memory.peak", "memory.max", "memory.current")
        else:
            raise CgroupUnavailable(f"{ROOT} has neither a v1 memory controller nor cgroup v2")
        self.peak_file, self.limit_file, self.usage_file = files
        self.limit_bytes = limit_bytes

    def __enter__(self) -> "MemoryGroup":
        try:
            self.path.mkdir()
            if self.version == 2 and not (self.path / "memory.peak").exists():
                raise CgroupUnavailable(f"a group under this process's own ({self.path.name}): no memory controller "
                                        "delegated (memory.peak missing)")
            (self.path / self.limit_file).write_text(str(self.limit_bytes))
        except OSError as e:
            raise CgroupUnavailable(f"cannot create memory cgroup {self.path}: {e}") from e
        return self

    def popen(self, cmd: list[str], **kwargs: object) -> subprocess.Popen:
        """Start `cmd` inside the group (it joins before exec: every child it spawns is inside too)."""
        procs = self.path / "cgroup.procs"

        def join() -> None:
            procs.write_text(str(os.getpid()))

        return subprocess.Popen(cmd, preexec_fn=join, start_new_session=True, **kwargs)  # type: ignore[call-overload]

    def _int(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def peak(self) -> int:
        return self._int(self.peak_file)

    def usage(self) -> int:
        return self._int(self.usage_file)

    def stat(self) -> dict[str, int]:
        out = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 30
        while self.path.exists():
            try:
                self.path.rmdir()  # v1 moves what is still charged to the parent
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def evict_page_cache(folder: Path) -> int:
    """Drop `folder`'s files from the page cache (written back first); returns their bytes."""
    total = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total
