"""Whether a start's other files (its Python code, shared libraries, the folder's small files) are
already in the page cache, judged from a sample, and which of them a read beside the weights still
needs ([Note: first files already cached]).

Owns: `looks_cached`, `needs_read`, `residency`, `is_library`.
Must never: read a file's contents (the answer would change), or import torch.
"""

from __future__ import annotations

from pathlib import Path

# [Note: first files already cached]
# When only the checkpoint left the page cache (a new model on a node that ran the engine, the
# issue's cold start), the start's other files are cached, yet reading them again took the child
# 2.7-5.4 s on the H200 (23,175 files: Python's open and read of each, and 4.9 GB of copies), and
# the rank's registration waited that long to start reading the weights
# (`ready-h200-2026-12-02-f`). A sample says whether they are cached: every shared library (most
# of the bytes) and an even spread of the rest; if the sample passes (the libraries and the rest
# each on its own: the libraries are most of the bytes, the rest most of the files), the child
# says so at once and reads beside the weights whatever files `needs_read` (those the sample
# missed, read behind the weights' reads, the cost the first phase exists to avoid, but only for
# those few files).
# A library is judged otherwise than the rest: a process maps a shared library and faults in only
# the pages it runs, so after the engine ran on a node its libraries are partly resident, the rest
# of their bytes never needed. Judged by bytes, a checkpoint-cold start after warm ones found them
# cold and read 4.87 GB of unused library pages before the weights (5.4-6.3 s, the registration
# waiting behind them: `ready-h200-2026-12-03-j` and `-k`, cold extra 1.14 against 0.93 without).
# So a library counts as cached once `TOUCHED` of it is resident (a process mapped it since the
# cache last lost it), the libraries once `CACHED_ENOUGH` of their files are, the rest once
# `CACHED_ENOUGH` of the sample's bytes are; the read beside the weights skips touched libraries.
CACHED_ENOUGH = 0.9
TOUCHED = 0.01  # of a shared library's bytes: a process has mapped it, the pages it uses are there
SAMPLE_SPREAD = 256  # of the other files
RESIDENCY_THREADS = 16  # residency checks in flight (a syscall or two per file)


def is_library(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def looks_cached(files: list[Path]) -> bool:
    """Whether `files` are in the page cache by a sample: every shared library, `CACHED_ENOUGH` of
    them `TOUCHED`, and `SAMPLE_SPREAD` of the rest evenly spread, `CACHED_ENOUGH` of their bytes
    resident (a file that cannot be measured counts as not resident)."""
    return sample_facts(files)["cached"]


def sample_facts(files: list[Path]) -> dict:
    """The sample `looks_cached` judges by, and its verdict: the libraries and how many of them are
    `TOUCHED` (with their bytes and resident bytes), the rest's sample and its resident share."""
    libraries = [f for f in files if is_library(f.name)]
    shared = set(libraries)
    rest = [f for f in files if f not in shared]
    sample = rest[:: max(1, len(rest) // SAMPLE_SPREAD)]
    counts = residency(libraries)
    touched = len(libraries) - sum(needs_read(f, c) for f, c in zip(libraries, counts))
    share = _resident_share(sample) if sample else 1.0
    cached = bool(libraries or sample) and touched >= CACHED_ENOUGH * len(libraries) and share >= CACHED_ENOUGH
    return {"cached": cached, "libraries": len(libraries), "libraries_touched": touched,
            "library_bytes": sum(n for _, n in counts), "library_resident_bytes": sum(r for r, _ in counts),
            "rest_sample": len(sample), "rest_resident_share": round(share, 4)}


def needs_read(f: Path, counts: tuple[int, int]) -> bool:
    """Whether `f`, with (resident bytes, bytes) in the page cache, is read beside the weights: a
    library not `TOUCHED`, any other file not whole (one that cannot be measured: read)."""
    res, size = counts
    if not size:
        return True
    return res < TOUCHED * size if is_library(f.name) else res < size


def residency(files: list[Path]) -> list[tuple[int, int]]:
    """(resident bytes, bytes) of each file (0, 0 for one that cannot be measured), in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from dlo.agent.residency import file_residency

    def one(f: Path) -> tuple[int, int]:
        try:
            r = file_residency(f)
        except OSError:  # gone or unreadable: the read decides what to do with it
            return 0, 0
        return r.resident_bytes, r.bytes

    with ThreadPoolExecutor(max_workers=RESIDENCY_THREADS, thread_name_prefix="dlo-residency") as pool:
        return list(pool.map(one, files))


def _resident_share(files: list[Path]) -> float:
    counts = residency(files)
    total = sum(size for _, size in counts)
    return sum(res for res, _ in counts) / total if total else 0.0
