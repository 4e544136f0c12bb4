"""Whether a start's other files (its Python code, shared libraries, the folder's small files) are
already in the page cache, judged from a sample, and which of them a read beside the weights still
needs ([Note: first files already cached]).

Owns: `looks_cached` and `sample_facts` (the verdict and what it was drawn from), `needs_read`,
`residency`, `is_library`, `is_code`.
Must never: read a file's contents (the answer would change), or import torch.
"""

from __future__ import annotations

from pathlib import Path

# [Note: first files already cached]
# When only the checkpoint left the page cache (a new model on a node that ran the engine, the
# issue's cold start), the start's other files are cached, yet reading them again took the child
# 2.7-5.4 s on the H200 (23,175 files: Python's open and read of each, and 4.9 GB of copies), and
# the rank's registration waited that long to start reading the weights
# (`ready-h200-2026-12-02-f`). A sample says whether the start's code is cached: an even spread of
# the Python files, and the shared libraries. Not by how much of it is resident: a start reads only
# the modules it imports (a Wan2.1 rank: 2,730 of the 22,440 Python files listed, 15.8% of their
# bytes, on the dev host) and faults in only the pages of a library it runs, so after warm starts
# most listed files were never read. Judged by bytes, as it first was, the first cold start after
# warm ones always read the 4.87 GB again (`ready-h200-2026-12-03-j`, `-k`, `-l`: 5.4-6.3 s, the
# registration waiting behind them); only a second one, after the first had read everything,
# found them cached. So the code counts as cached once `USED_SHARE` of the sample's bytes is
# resident (a page cache dropped since: ~0, only what the server imported so far) and, where there
# are libraries, once one of them is touched at all. Then the child says so at once and reads
# beside the weights only the other files not whole (the folder's configs and tokenizers, the
# distributions' metadata): the code a start uses is there, and code no start read is not needed.
USED_SHARE = 0.05  # of the Python files' sample bytes resident: a start has run since the cache lost them
SAMPLE_SPREAD = 256  # of the Python files
RESIDENCY_THREADS = 16  # residency checks in flight (a syscall or two per file)


def is_library(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def is_code(name: str) -> bool:
    """A file a start reads only if it runs it: Python source and bytecode, shared libraries."""
    return name.endswith((".py", ".pyc")) or is_library(name)


def looks_cached(files: list[Path]) -> bool:
    """Whether the code among `files` is in the page cache by a sample ([Note: first files already
    cached]): `USED_SHARE` of the bytes of `SAMPLE_SPREAD` Python files evenly spread resident, and
    a library touched where there are any (a file that cannot be measured counts as not resident)."""
    return sample_facts(files)["cached"]


def sample_facts(files: list[Path]) -> dict:
    """The sample `looks_cached` judges by, and its verdict: the libraries and how many of them are
    touched (with their bytes and resident bytes), the Python files' sample and its resident share."""
    libraries = [f for f in files if is_library(f.name)]
    python = [f for f in files if is_code(f.name) and not is_library(f.name)]
    sample = python[:: max(1, len(python) // SAMPLE_SPREAD)]
    counts = residency(libraries)
    touched = sum(1 for res, _ in counts if res > 0)
    share = _resident_share(sample) if sample else 1.0
    cached = bool(libraries or sample) and share >= USED_SHARE and (touched > 0 or not libraries)
    return {"cached": cached, "libraries": len(libraries), "libraries_touched": touched,
            "library_bytes": sum(n for _, n in counts), "library_resident_bytes": sum(r for r, _ in counts),
            "rest_sample": len(sample), "rest_resident_share": round(share, 4)}


def needs_read(f: Path, counts: tuple[int, int]) -> bool:
    """Whether `f`, with (resident bytes, bytes) in the page cache, is read beside the weights once
    the code looks cached: a file other than code that is not whole (one that cannot be measured:
    read); code never (what a start runs is cached, the rest is not needed)."""
    res, size = counts
    if is_code(f.name):
        return False
    return not size or res < size


def residency(files: list[Path]) -> list[tuple[int, int]]:
    """(resident bytes, bytes) of each file (0, 0 for one that cannot be measured), in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from dlo.pagecache.residency import file_residency

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
