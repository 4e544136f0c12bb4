"""The readahead of a cold checkpoint in a process of its own (`python -m dlo.engine.serving.readahead`).

Why a process: the reads run on `dlo.agent.warm`'s thread pool, whose threads take the GIL back
after every chunk. Beside a rank's imports and model builds (GIL-bound Python), eight of them
starved the main thread: on the H200 a cold Wan2.1 start spent 23-25 s in imports that take 2.3 s
warm, while the disk read the folder in 20 s (`ready-h200-2026-12-01`; bench/NOTES.md section 20).
A child shares no GIL, and the pages it reads are the same page-cache pages the rank maps.

[Note: the start's other files first]
Why the start's other files first: a cold node has its Python libraries out of the page cache too,
and a read of the weights keeps the disk's queue full. On the H200 a cold start's imports took
28-30 s against 2.8 s warm, with the readahead in this child (`ready-h200-2026-12-01-c`): every
small read of a `.pyc` or `.so` waited behind the weights' readahead. So the child reads, before the
weights, what the start reads besides them: the Python files and shared libraries of the packages
a rank imports (`--package`) and the pipeline folder's small files, configs and tokenizers
(`--folder`); and it does not advise the kernel to read whole files ahead (its threads' reads keep
the disk busy; the advice queued the whole folder in front of every other read).

Owns: `read_in_child` (the parent's side: run the child, wait, parse its one JSON line; its
warnings go to the rank's log), `startup_files` (what is read first) and `main` (the child: arm
the parent-death signal first, exit if the parent is already gone, read the start's other files,
then warm the weights in the order given, print what it read).
Must never: outlive the process that started it (parent-death signal), write to a model file, or
import torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

THREADS = 8  # requests in flight: enough for an NVMe disk, 8 x 16 MiB of buffers at most

log = logging.getLogger(__name__)


class ReadaheadError(RuntimeError):
    """The readahead's child failed (its last line of stderr says why)."""


WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")  # a folder's files read after the rest


def read_in_child(files: list[Path], threads: int = THREADS, packages: tuple[Path, ...] = (),
                  folders: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Warm `files` (in this order) in a child process, the `startup_files` of `packages` and
    `folders` first; what it read: files, bytes, seconds, pid, and `first` (files, bytes, seconds)."""
    argv = [sys.executable, "-m", __name__, "--threads", str(threads), "--parent-pid", str(os.getpid()),
            *(a for p in packages for a in ("--package", str(p))), *(a for f in folders for a in ("--folder", str(f))),
            *map(str, files)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise ReadaheadError(f"the readahead process failed: {why}")
    if proc.stderr.strip():  # warnings of a read that still finished: the rank's log keeps them
        log.warning("the readahead process said: %s", proc.stderr.strip()[-2000:])
    return json.loads(lines[-1])


def _is_code(name: str) -> bool:
    return name.endswith((".py", ".pyc", ".so")) or ".so." in name


def startup_files(packages: tuple[Path, ...], folders: tuple[Path, ...]) -> list[Path]:
    """What a start reads besides the weights, in this order: each package's Python files and shared
    libraries (`.py`, `.pyc`, `.so`, `.so.N`), then each folder's files that are not weights."""
    from dlo.agent.tree import FolderTooDeep, walk_files

    out: list[Path] = []
    for roots, keep in ((packages, _is_code), (folders, lambda name: not name.endswith(WEIGHTS))):
        for root in roots:
            try:
                out.extend(f for f in walk_files(root) if keep(f.name) and f.is_file())
            except (FolderTooDeep, OSError) as e:  # what was found before stays; the start goes on
                log.warning("the readahead skips the rest of %s: %s", root, e)
    return out


def read_first(files: list[Path], threads: int) -> dict[str, Any]:
    """Read `files` whole, `threads` at a time (most are small: one read each); files, bytes, seconds."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from dlo.agent.warm import read_whole

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dlo-first") as pool:
        read = sum(pool.map(read_whole, files))
    return {"files": len(files), "bytes": read, "seconds": round(time.monotonic() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    from dlo.engine.serving.rank_main import die_with_parent

    die_with_parent()  # first: a parent gone from here on kills this process
    ap = argparse.ArgumentParser(prog="python -m dlo.engine.serving.readahead",
                                 description="Read FILES into the page cache, in order (a rank's cold start).")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer the parent")
    ap.add_argument("--package", type=Path, action="append", default=[],
                    help="a package folder whose Python files and shared libraries are read first")
    ap.add_argument("--folder", type=Path, action="append", default=[],
                    help="a folder whose files other than weights are read first (after the packages')")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the parent went before the death signal was armed: nobody waits for this read
    from dlo.agent.warm import warm

    first = read_first(startup_files(tuple(args.package), tuple(args.folder)), args.threads)
    session = warm(args.files, threads=args.threads, advise=False)
    print(json.dumps({"files": len(args.files), "bytes": session.after.bytes, "seconds": round(session.seconds, 2),
                      "pid": os.getpid(), "first": first}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
