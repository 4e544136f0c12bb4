"""Page-cache residency of model files: how many of a file's bytes the OS page cache holds.

Owns: `cachestat(2)` (Linux >= 6.5; counts cached pages without mapping the file) with a
`mincore(2)` fallback (maps the file read-only and asks which pages are resident, touching none),
the thin libc bindings both use, and the list of a model folder's safetensors files.
Used by `dlo warm` (before and after warming) and by the exporter (`dlo_model_page_cache_*`).
Must never: read file contents (that would change the answer), or import torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dlo.pagecache.tree import walk_files

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
Method = Literal["cachestat", "mincore"]

# cachestat is number 451 in the generic syscall table, which x86_64 and arm64 share for it.
_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451, "arm64": 451}.get(platform.machine())
MADV_WILLNEED = 3


# mincore is asked about this many pages at a time (1 GiB of 4 KiB pages: a 256 KiB vector).
_MINCORE_CHUNK_PAGES = 1 << 18
_LOW_BIT = bytes(b & 1 for b in range(256))


class ResidencyError(OSError):
    """A file's residency could not be measured (unreadable, or neither syscall works)."""


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


def _load_libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    lib.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return lib


libc = _load_libc()
MAP_FAILED = ctypes.c_void_p(-1).value


def _errno_error(what: str, path: Path | str) -> ResidencyError:
    err = ctypes.get_errno()
    return ResidencyError(err, f"{what}: {os.strerror(err)}", str(path))


class Mapping:
    """A read-only shared mapping of a whole file made through libc, so we know its address."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self.addr: int | None = None
        if self.size == 0:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, MAP_FAILED):
            raise _errno_error("mmap", self.path)
        self.addr = addr

    def advise_willneed(self) -> None:
        if self.addr is not None and libc.madvise(self.addr, self.size, MADV_WILLNEED) != 0:
            raise _errno_error("madvise(WILLNEED)", self.path)

    def lock(self) -> None:
        """mlock the mapping: pages stay resident (and are charged to this cgroup) until unlocked."""
        if self.addr is not None and libc.mlock(self.addr, self.size) != 0:
            raise _errno_error("mlock", self.path)

    def resident_pages(self) -> int:
        """Resident pages by mincore(2), asked in chunks so that no single call holds the GIL for
        long (a scan runs next to the agent's HTTP threads) nor allocates a vector per page of a
        whole multi-TB file."""
        if self.addr is None:
            return 0
        pages = -(-self.size // PAGE)
        chunk = min(pages, _MINCORE_CHUNK_PAGES)
        vec = (ctypes.c_ubyte * chunk)()
        resident = 0
        for first in range(0, pages, chunk):
            n = min(chunk, pages - first)
            length = min(n * PAGE, self.size - first * PAGE)
            if libc.mincore(self.addr + first * PAGE, length, vec) != 0:
                raise _errno_error("mincore", self.path)
            resident += ctypes.string_at(vec, n).translate(_LOW_BIT).count(1)  # bit 0: resident
        return resident

    def close(self) -> None:
        if self.addr is not None:
            libc.munmap(self.addr, self.size)
            self.addr = None

    def __enter__(self) -> "Mapping":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_cachestat_works: bool | None = None


def _cachestat_pages(path: Path, size: int) -> int | None:
    """Cached pages of `path` by cachestat(2), or None where the kernel lacks it."""
    global _cachestat_works
    if _CACHESTAT_NR is None or _cachestat_works is False:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        rng = _CachestatRange(0, size)
        out = _Cachestat()
        rc = libc.syscall(_CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(out), 0)
    finally:
        os.close(fd)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (38, 1):  # ENOSYS: old kernel; EPERM: seccomp filter denies it
            _cachestat_works = False
            log.info("cachestat unavailable, using mincore errno=%d", err)
            return None
        raise ResidencyError(err, f"cachestat: {os.strerror(err)}", str(path))
    _cachestat_works = True
    return int(out.nr_cache)


@dataclass(frozen=True)
class FileResidency:
    path: str
    bytes: int
    resident_bytes: int
    method: Method

    @property
    def ratio(self) -> float:
        return 1.0 if self.bytes == 0 else self.resident_bytes / self.bytes


def file_residency(path: Path | str, method: Method | None = None) -> FileResidency:
    """Resident bytes of one file (page-granular, capped at the file size)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        pages = None if method == "mincore" else _cachestat_pages(p, size)
        used: Method = "cachestat"
        if pages is None:
            if method == "cachestat":
                raise ResidencyError(38, "cachestat is not available on this kernel", str(p))
            with Mapping(p) as m:
                pages = m.resident_pages()
            used = "mincore"
    except ResidencyError:
        raise
    except OSError as e:
        raise ResidencyError(e.errno or 0, f"cannot measure residency: {e.strerror or e}", str(p)) from e
    return FileResidency(str(p), size, min(size, pages * PAGE), used)


def model_files(path: Path | str) -> list[Path]:
    """The safetensors files of `path`: itself if a file, else every `*.safetensors` below it."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        if p.exists():  # a FIFO, a device, a socket: there, but nothing to map
            raise ResidencyError(f"{p}: not a regular file or a folder (a FIFO, device or socket)")
        raise FileNotFoundError(f"{p}: no such file or folder")
    return sorted(f for f in walk_files(p, (".safetensors",)) if f.is_file())


@dataclass(frozen=True)
class Residency:
    files: list[FileResidency]

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def resident_bytes(self) -> int:
        return sum(f.resident_bytes for f in self.files)

    @property
    def ratio(self) -> float:
        return 1.0 if self.bytes == 0 else self.resident_bytes / self.bytes

    @property
    def min_ratio(self) -> float:
        return min((f.ratio for f in self.files), default=1.0)


def folder_residency(path: Path | str, method: Method | None = None) -> Residency:
    return Residency([file_residency(f, method) for f in model_files(path)])
