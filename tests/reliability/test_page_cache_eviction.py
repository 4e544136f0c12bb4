"""The page cache evicted under a serving engine: with `--weights registered` the ranks read block
bytes straight from the safetensors mapping (the page cache, read in place on cpu). Evicting those
pages while serving must not change a single output byte; the engine faults them back in from disk.

`posix_fadvise(DONTNEED)` alone drops only pages no process maps (measured: 0 bytes of the mapped
transformer file left the cache), so eviction first pages out the rank's mappings of the model
files (`process_madvise` with MADV_PAGEOUT), then drops the unmapped pages with DONTNEED (after an
fsync: dirty pages of a freshly written model cannot be dropped). MADV_PAGEOUT leaves pages that
more than one process maps, and with dp 2 both ranks map every page of the tiny file, so this runs
one rank (rank-local): the same read-in-place path every rank runs. Residency is measured with the
agent's `folder_residency` (cachestat, else mincore)."""

from __future__ import annotations

import base64
import ctypes
import os
import statistics
import threading
import time
from pathlib import Path

import pytest
import requests

from dlo.pagecache.residency import folder_residency, model_files
from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import sha, tiny_pipeline, wait_until
from tests.reliability.figures import record

pytestmark = pytest.mark.slow

SYS_PIDFD_OPEN, SYS_PROCESS_MADVISE, MADV_PAGEOUT = 434, 440, 21  # x86_64 and aarch64 share these
BODY = {"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 11}
ROUNDS = 6


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def evict(files: list[Path], pids: list[int]) -> int:
    """Page out every mapping of `files` in `pids`, then drop them from the page cache; bytes paged out."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    names = {str(f.resolve()) for f in files}
    paged = 0
    for pid in pids:
        pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_open({pid})")
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5] in names:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    iov = _IoVec(lo, hi - lo)
                    done = libc.syscall(SYS_PROCESS_MADVISE, pidfd, ctypes.byref(iov), 1, MADV_PAGEOUT, 0)
                    if done < 0:
                        raise OSError(ctypes.get_errno(), f"process_madvise({pid}, MADV_PAGEOUT)")
                    paged += done
        finally:
            os.close(pidfd)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a freshly written model) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return paged


def evict_until_mostly_gone(files: list[Path], pids: list[int], folder: Path, deadline_s: float = 10.0) -> int:
    """Evict until under half of `folder` is resident; its resident bytes then.

    MADV_PAGEOUT is best effort: a page the kernel cannot isolate at that moment (one still in a
    per-CPU LRU batch after its fault, or locked by a concurrent reader) stays mapped and cached, so one
    pass sometimes leaves half the tiny file (seen once in CI: 114,688 of 224,288 bytes). The state is
    polled with a deadline, never assumed after one pass."""
    total = folder_residency(folder).bytes

    def mostly_gone() -> bool:
        evict(files, pids)
        return folder_residency(folder).resident_bytes < 0.5 * total

    wait_until(mostly_gone, deadline_s, f"under half of {folder} is in the page cache", poll_s=0.01)
    return folder_residency(folder).resident_bytes


def _png(srv: ServerProcess) -> tuple[str, float]:
    """Hash of the PNG and seconds of one request."""
    t0 = time.perf_counter()
    r = requests.post(srv.url + "/v1/images/generations", json=BODY, timeout=60)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:300]
    return sha(base64.b64decode(r.json()["data"][0]["b64_json"])), took


def test_outputs_stay_byte_identical_when_the_page_cache_is_evicted_under_the_engine(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    transformer = model / "transformer"
    files = model_files(transformer)
    srv = ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--small-limits",
                        "--weights", "registered", log_path=tmp_path / "serve.log")
    with srv:
        assert srv.proc is not None
        sources = {r["rank"]: r["report"]["weights_source"] for r in srv.ready_info()["ranks"]}
        assert sources == {0: "registered"}, sources
        pids = [srv.proc.pid]

        baseline = [_png(srv) for _ in range(ROUNDS)]
        want = baseline[0][0]
        assert all(h == want for h, _ in baseline)

        # evict between requests: the next request must fault the block bytes back in from disk
        after_evictions, resident = [], []
        for _ in range(ROUNDS):
            before = folder_residency(transformer).resident_bytes
            evicted = evict_until_mostly_gone(files, pids, transformer)
            got, took = _png(srv)
            refilled = folder_residency(transformer).resident_bytes
            assert got == want, "an output changed after the page cache was evicted"
            after_evictions.append(took)
            resident.append((before, evicted, refilled))
        total = folder_residency(transformer).bytes
        # most of the file left the page cache, and the engine read it back
        assert all(e < 0.5 * total for _, e, _ in resident), (total, resident)
        assert all(r > e for _, e, r in resident), (total, resident)

        # evict continuously while requests run
        stop = threading.Event()
        evictions = [0]

        def evictor() -> None:
            while not stop.wait(0.005):
                evict(files, pids)
                evictions[0] += 1

        thread = threading.Thread(target=evictor, daemon=True)
        thread.start()
        try:
            during = [_png(srv) for _ in range(ROUNDS)]
        finally:
            stop.set()
            thread.join(10)
        assert all(h == want for h, _ in during), "an output changed while the page cache was being evicted"
        assert evictions[0] >= ROUNDS

    def ms(xs: list[float]) -> float:
        return round(1000 * statistics.median(xs), 1)

    record("page_cache_eviction", transformer_bytes=total, rounds=ROUNDS,
           resident_bytes_before_evicted_after_request=[list(x) for x in resident],
           median_ms_warm=ms([t for _, t in baseline]), median_ms_first_request_after_eviction=ms(after_evictions),
           median_ms_during_continuous_eviction=ms([t for _, t in during]), evictions_during=evictions[0],
           outputs_identical=True)
