"""What a cold checkpoint's readahead costs the imports beside it: threads in the rank's process
against a child process (`dlo.serving.readahead`), each round in a fresh interpreter.

    python bench/readahead_gil.py --file /tmp/gil/model.safetensors --gib 4 --rounds 3

Per round and mode the file is dropped from the page cache (POSIX_FADV_DONTNEED), the readahead
starts, and the interpreter imports diffusers' Wan pipeline (the GIL-bound work of a rank's start)
while it runs; the import seconds are printed, then the readahead joined. Modes: `none` (no
readahead), `threads` (`dlo.pagecache.warm`'s pool on a thread of this process: the code before
2026-12-01), `child` (`start_readahead` as shipped: the pool in a child process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROUND = r"""
import json, os, sys, time
from pathlib import Path
f, mode = Path(sys.argv[1]), sys.argv[2]
fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
if mode == "threads":
    from dlo.pagecache.warm import warm
    from dlo.serving.prewarm import Background
    job = Background("readahead", lambda: warm([f], threads=8))
elif mode == "child":
    from dlo.serving.prewarm import start_readahead
    job = start_readahead(f.parent, ())
t0 = time.perf_counter()
import diffusers, transformers  # noqa: E401
from diffusers import WanPipeline  # noqa: F401
imports = time.perf_counter() - t0
if mode != "none":
    if job is None:
        raise SystemExit("the file was still in the page cache: nothing was read")
    job.join()
print(json.dumps({"mode": mode, "imports_s": round(imports, 2), "with_read_s": round(time.perf_counter() - t0, 2)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, default=Path("/tmp/gil/model.safetensors"), help="alone in its folder")
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.file.parent.mkdir(parents=True, exist_ok=True)
    if not args.file.exists() or args.file.stat().st_size != args.gib << 30:
        with open(args.file, "wb") as out:
            for _ in range(args.gib * 64):
                out.write(os.urandom(16 << 20))
            out.flush()
            os.fsync(out.fileno())  # dirty pages cannot be dropped from the page cache
    rows = []
    for _ in range(args.rounds):
        for mode in ("none", "threads", "child"):
            proc = subprocess.run([sys.executable, "-c", ROUND, str(args.file), mode], capture_output=True, text=True,
                                  check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    summary = {m: statistics.median(r["imports_s"] for r in rows if r["mode"] == m) for m in ("none", "threads", "child")}
    print(json.dumps({"imports_s_median": summary, "cpus": os.cpu_count(), "gib": args.gib,
                      "date": time.strftime("%Y-%m-%d")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
