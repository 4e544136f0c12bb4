"""What pinning a cold file does to the rest of the process (issue 34, [Note: pin what is read] in
`dlo.engine.weights`): while one thread registers a file's read-only mapping for DMA
(`cudaHostRegister`), the main thread maps and touches 1 MiB of anonymous memory again and again
(what an import's `dlopen` and the allocator do) and times each; once with the file's folder evicted
from the page cache (the driver reads it while pinning), once with it read first.

    python3 bench/pin_stall_probe.py FILE --out raw-pin-stall.json   # a large file (GBs), cuda

Prints and writes {case: {register_seconds, probes, probe_ms_median, probe_ms_max, stalled_ms}}:
`stalled_ms` sums the probes over 10 ms.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ready_h200 import evict  # noqa: E402  (a folder's safetensors out of the page cache)

READ_ONLY = 8  # cudaHostRegisterReadOnly


def probe_while_registering(path: Path) -> dict:
    import numpy as np
    import torch

    torch.cuda.init()
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    ptr = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    done, took = threading.Event(), []

    def register() -> None:
        t0 = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(ptr, len(mapped), READ_ONLY)
        took.append((time.perf_counter() - t0, int(err)))
        done.set()

    probes: list[float] = []
    thread = threading.Thread(target=register)
    thread.start()
    while not done.is_set():
        t0 = time.perf_counter()
        anon = mmap.mmap(-1, 1 << 20)
        anon[0] = 1
        anon.close()
        probes.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.001)
    thread.join()
    torch.cuda.cudart().cudaHostUnregister(ptr)
    seconds, err = took[0]
    return {"register_seconds": round(seconds, 3), "cuda_error": err, "probes": len(probes),
            "probe_ms_median": round(statistics.median(probes), 3) if probes else None,
            "probe_ms_max": round(max(probes), 1) if probes else None,
            "stalled_ms": round(sum(p for p in probes if p > 10), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    out = {"file": str(args.file), "bytes": args.file.stat().st_size}
    evict(args.file.parent)  # the file's folder: the file among them
    out["cold"] = probe_while_registering(args.file)
    from dlo.pagecache.warm import warm

    warm([args.file])  # read into the page cache, as `dlo warm` does
    out["read_first"] = probe_while_registering(args.file)
    print(json.dumps(out, indent=1))
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
