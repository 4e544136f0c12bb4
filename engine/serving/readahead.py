"""The readahead of a cold checkpoint in a process of its own (`python -m dlo.engine.serving.readahead`).

Why a process: the reads run on `dlo.agent.warm`'s thread pool, whose threads take the GIL back
after every chunk. Beside a rank's imports and model builds (GIL-bound Python), eight of them
starved the main thread: on the H200 a cold Wan2.1 start spent 23-25 s in imports that take 2.3 s
warm, while the disk read the folder in 20 s (`ready-h200-2026-12-01`; bench/NOTES.md section 20).
A child shares no GIL, and the pages it reads are the same page-cache pages the rank maps.

Owns: `read_in_child` (the parent's side: run the child, wait, parse its one JSON line; its
warnings go to the rank's log) and `main` (the child: arm the parent-death signal first, exit if
the parent is already gone, warm the files in the order given, print what it read).
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


def read_in_child(files: list[Path], threads: int = THREADS) -> dict[str, Any]:
    """Warm `files` (in this order) in a child process; what it read: files, bytes, seconds, pid."""
    argv = [sys.executable, "-m", __name__, "--threads", str(threads), "--parent-pid", str(os.getpid()),
            *map(str, files)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise ReadaheadError(f"the readahead process failed: {why}")
    if proc.stderr.strip():  # warnings of a read that still finished: the rank's log keeps them
        log.warning("the readahead process said: %s", proc.stderr.strip()[-2000:])
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    from dlo.engine.serving.rank_main import die_with_parent

    die_with_parent()  # first: a parent gone from here on kills this process
    ap = argparse.ArgumentParser(prog="python -m dlo.engine.serving.readahead",
                                 description="Read FILES into the page cache, in order (a rank's cold start).")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer the parent")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the parent went before the death signal was armed: nobody waits for this read
    from dlo.agent.warm import warm

    session = warm(args.files, threads=args.threads)
    print(json.dumps({"files": len(args.files), "bytes": session.after.bytes, "seconds": round(session.seconds, 2),
                      "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
