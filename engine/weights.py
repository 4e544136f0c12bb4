"""Where a rank's block bytes come from on the host: the page cache itself, or a pinned arena.

Owns: choosing the weights source and turning each offloaded block into a short list of host->slot
copies `(host bytes, offset in this rank's shard)`.
- `registered`: the safetensors file mappings themselves are registered for DMA (CUDA:
  `cudaHostRegister` with the read-only flag on the read-only mmap). Copies run straight from the
  page cache to their slot offsets: no arena, no copy at start-up, and a node holds exactly one copy
  of the model (its page cache) in every mode. A block is one run per dtype when its tensors keep
  256-byte sizes, as safetensors files group tensors by dtype then name.
- `arena`: the fallback (platforms that cannot register, casts needed, layouts that break into many
  small runs): one exact-size pinned allocation per rank (see `dlo.engine.arena`).
`EarlyRegistration` starts the registration of a checkpoint's files on a thread before the model is
built (`cudaHostRegister` releases the GIL): the driver pins the page cache while the loader imports
and builds the model, and resident copies then run from registered memory at DMA speed, file by
file as each is registered (`dlo.engine.placement`).
Must never: register or pin per tensor, or fall back silently (the choice and why are logged and
reported), or leave a file registered that no `HostWeights` owns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Protocol

import torch

from dlo.engine.arena import build_arena
from dlo.engine.checkpoint import Checkpoint
from dlo.engine.layout import BlockLayout, shard_pieces
from dlo.engine.platform import Platform

log = logging.getLogger(__name__)

WeightsChoice = Literal["auto", "arena", "registered"]
# the bytes of a tensor the slots hold other than as the folder does (an FP8 weight converted at
# load, `dlo.engine.quantize.InMemoryFp8`), or None for a tensor read from the folder
Derived = Callable[[str], "torch.Tensor | None"]
# Past this many separate runs in one block, per-copy launch cost beats the saved memory: use the arena.
MAX_RUNS_PER_BLOCK = 64


@dataclass
class HostWeights:
    source: str  # "registered" | "arena"
    copies: list[list[tuple[torch.Tensor, int]]]
    pinned_bytes: int  # host bytes this process made DMA-able
    pinned: bool
    reason: str
    _release: list[Callable[[], None]] = field(default_factory=list)
    _keepalive: object = None  # the arena whose buffer the copies view

    def release(self) -> None:
        for fn in self._release:
            fn()
        self._release.clear()
        self.pinned = False


@dataclass(frozen=True)
class Run:
    path: Path
    start: int  # absolute file offset
    dst: int  # offset in the rank's shard
    n: int


class ReadFront(Protocol):
    """A cold start's readahead as an early registration waits for it
    (`dlo.serving.prewarm.Readahead`): `until_resident(path, stop)` returns once `path` is in
    the page cache (or the readahead ended, or `stop` is set), with the seconds it waited. The child
    reads the start's other files before any weights file, so waiting for each file also keeps the
    pinning behind those."""

    def until_resident(self, path: Path, stop: threading.Event) -> float: ...


class EarlyRegistration:
    """Every file of `ckpt` registered for DMA (read-only, whole files, in order) on a daemon thread,
    started now. `wait_for(path)` waits for one file (the resident copies read each file as soon as
    it is registered), `wait()` for all and says whether all were registered; `adopt(paths)` hands
    the registrations of `paths` to the caller and unregisters the rest; `release()` unregisters
    all. `hold_until(event)`: copies still read the registered files until `event` (the resident
    copies, `dlo.engine.placement`): nothing is unregistered before it has completed. The copies
    must view the same mappings: use `ckpt` (this object's) for the load."""

    def __init__(self, ckpt: Checkpoint, platform: Platform, device: torch.device,
                 after: ReadFront | None = None):
        """`after`: a cold start's readahead. Registering pins each file once the readahead has read
        it ([Note: pin what is read]), so neither the pinning nor the start's other files, which the
        readahead reads first, queue behind a weights file's read."""
        self.ckpt = ckpt
        self.platform = platform
        self.registered: dict[Path, tuple[int, int]] = {}  # path -> (pointer, bytes)
        self.problem = ""  # why not every file is registered ("" when all are)
        self._progress = threading.Condition()  # notified as each file is registered, and at the end
        self._ended = False  # the thread has registered what it will (under `_progress`)
        self._fence: object = None
        self._released = threading.Event()  # `release()` was called: stop registering (a failed load's clean-up)

        def run() -> None:
            t0 = time.perf_counter()
            behind = [0.0]  # seconds waiting for the readahead to read each file

            def wait_for_read(path: Path) -> None:
                if after is not None:
                    behind[0] += after.until_resident(path, self._released)

            try:
                platform.device(device.index or 0)  # the caller's device (`early_registration` resolves it)
                self.problem = _register_files(ckpt, ckpt.files, platform, self.registered, self._progress,
                                               self._released, wait_for_read)
            except Exception as e:  # reported by wait(); the load falls back as for a refusal
                self.problem = f"registering the page cache failed: {type(e).__name__}: {e}"
            released = self._released.is_set()  # stopped on purpose (the load needs no more): not a problem
            suffix = (" (released: the load needs no more of it)" if released else
                      f" ({self.problem}; the files this rank uses are registered again when its host weights "
                      "are prepared)" if self.problem else "")
            log.log(logging.WARNING if self.problem and not released else logging.INFO,
                    "early registration of %s: %d of %d files, %d bytes, %.2f s (%.2f s of it waiting for "
                    "the readahead to read the weights)%s", ckpt.root.name,
                    len(self.registered), len(ckpt.files), sum(n for _, n in self.registered.values()),
                    time.perf_counter() - t0, behind[0], suffix)
            with self._progress:
                self._ended = True
                self._progress.notify_all()

        self._thread = threading.Thread(target=run, name="dlo-register", daemon=True)
        self._thread.start()

    def wait_for(self, path: Path) -> bool:
        """Wait until `path` is registered (True) or the registration ended without it (False)."""
        with self._progress:
            self._progress.wait_for(lambda: path in self.registered or self._ended)
            return path in self.registered

    def wait(self) -> bool:
        self._thread.join()
        return not self.problem

    def hold_until(self, event: object) -> None:
        self._fence = event

    def adopt(self, paths: set[Path]) -> list[tuple[int, int]]:
        self.wait()
        kept = [v for p, v in self.registered.items() if p in paths]
        self.registered = {p: v for p, v in self.registered.items() if p not in paths}
        self.release()
        return kept

    def release(self) -> None:
        self._released.set()  # a registration still waiting or under way stops at the next file
        self.wait()
        if self.registered and self._fence is not None:
            self.platform.host_wait(self._fence)  # no DMA may still read what is unregistered
        for ptr, _ in self.registered.values():
            self.platform.unregister(ptr)
        self.registered.clear()


def _register_files(ckpt: Checkpoint, paths: list[Path], platform: Platform,
                    into: dict[Path, tuple[int, int]], progress: threading.Condition | None = None,
                    stop: threading.Event | None = None, before: Callable[[Path], None] | None = None) -> str:
    """Register whole files for DMA in order, each into `into` (path -> (pointer, bytes)) as it
    succeeds (notifying `progress`), until `stop` is set; `before(path)` runs first for each file.
    Returns why it stopped ("" when every file is registered)."""
    for path in paths:
        if before is not None:
            before(path)
        if stop is not None and stop.is_set():
            return "released before every file was registered"
        whole = ckpt.file_bytes(path)
        if not platform.register_read_only(whole.data_ptr(), whole.numel()):
            return f"the platform refused to register {path.name}"
        if progress is None:
            into[path] = (whole.data_ptr(), whole.numel())
            continue
        with progress:
            into[path] = (whole.data_ptr(), whole.numel())
            progress.notify_all()
    return ""


def page_cache_runs(ckpt: Checkpoint, lay: BlockLayout, g: int, r: int) -> list[Run]:
    """Rank r's shard of a block as file runs, merged where file and slot are both contiguous."""
    runs: list[Run] = []
    for p in shard_pieces(lay, g, r):
        info = ckpt.tensors[p.name]
        start = info.start + p.src
        last = runs[-1] if runs else None
        if last and last.path == info.path and last.start + last.n == start and last.dst + last.n == p.dst:
            runs[-1] = Run(last.path, last.start, last.dst, last.n + p.n)
        else:
            runs.append(Run(info.path, start, p.dst, p.n))
    return runs


def prepare_host_weights(
    ckpt: Checkpoint,
    layouts: list[BlockLayout],
    target_dtype: dict[str, str],
    g: int,
    r: int,
    platform: Platform,
    prefer: WeightsChoice = "auto",
    early: EarlyRegistration | None = None,
    derived: Derived | None = None,
) -> HostWeights:
    """`early`: this checkpoint's files already being registered (`EarlyRegistration` over `ckpt`);
    the registered source adopts them, every other outcome releases them. `derived`: the bytes of
    tensors the folder does not hold as the slots do (FP8 converted at load): they need the arena."""
    if prefer not in ("auto", "arena", "registered"):
        raise ValueError(f"weights must be auto, arena or registered; got {prefer!r}")
    try:
        return _prepare(ckpt, layouts, target_dtype, g, r, platform, prefer, early, derived)
    finally:
        if early is not None:
            early.release()  # a no-op after `adopt`: what the weights did not take is unregistered


def _prepare(ckpt: Checkpoint, layouts: list[BlockLayout], target_dtype: dict[str, str], g: int, r: int,
             platform: Platform, prefer: WeightsChoice, early: EarlyRegistration | None,
             derived: Derived | None = None) -> HostWeights:
    reason = ""
    if prefer != "arena" and derived is not None:
        reason = "FP8 weights converted at load (the arena holds them: half their bfloat16 bytes)"
        if prefer == "registered":
            raise RuntimeError(f"weights 'registered' not possible: {reason}; `dlo quantize` writes a folder "
                               "that streams FP8 from the page cache")
    elif prefer != "arena":
        runs = [page_cache_runs(ckpt, lay, g, r) for lay in layouts]
        casts = [t.name for lay in layouts for t in lay.tensors if ckpt.tensors[t.name].dtype != t.dtype]
        most = max((len(x) for x in runs), default=0)
        if casts:
            reason = f"{len(casts)} block tensors need a dtype cast (e.g. {casts[0]})"
        elif most > MAX_RUNS_PER_BLOCK:
            reason = f"a block breaks into {most} file runs (> {MAX_RUNS_PER_BLOCK}); repack the model aligned"
        elif prefer == "auto" and not platform.has_streams:
            reason = "host memory is the device memory on cpu: the arena keeps accounting explicit"
        else:
            hw = _register(ckpt, runs, platform, early)
            if hw is not None:
                return hw
            reason = "the platform refused to register the file mappings"
        if prefer == "registered":
            raise RuntimeError(f"weights 'registered' not possible: {reason}")
    arena = build_arena(ckpt, layouts, target_dtype, g, r, platform, derived)
    hw = HostWeights(
        source="arena",
        copies=[[(arena.shard(i), 0)] for i in range(len(layouts))],
        pinned_bytes=arena.nbytes if arena.pinned else 0,
        pinned=arena.pinned,
        reason=reason or "requested",
        _keepalive=arena,
    )
    if arena.pinned:
        hw._release.append(lambda: platform.unpin(arena.buffer))
    log.info("weights source=arena bytes=%d pinned=%s reason=%r", arena.nbytes, arena.pinned, hw.reason)
    return hw


def _register(ckpt: Checkpoint, runs: list[list[Run]], platform: Platform,
              early: EarlyRegistration | None = None) -> HostWeights | None:
    used = sorted({run.path for block in runs for run in block})
    registered: list[tuple[int, int]] = []
    if early is not None and platform.has_streams and early.wait():
        registered = early.adopt(set(used))
    elif platform.has_streams:
        # no early registration, or it failed (perhaps on a file this rank does not use): the files
        # used, in order, as before
        if early is not None:
            early.release()
        done: dict[Path, tuple[int, int]] = {}
        if _register_files(ckpt, used, platform, done):
            for ptr, _ in done.values():
                platform.unregister(ptr)
            return None
        registered = list(done.values())
    whole = {path: ckpt.file_bytes(path) for path in used}
    copies = [[(whole[run.path][run.start : run.start + run.n], run.dst) for run in block] for block in runs]
    hw = HostWeights(
        source="registered",
        copies=copies,
        pinned_bytes=sum(n for _, n in registered),
        pinned=bool(registered),
        reason="page cache registered for DMA" if registered else "page cache read in place (cpu)",
    )
    hw._release.extend(lambda p=ptr: platform.unregister(p) for ptr, _ in registered)
    log.info("weights source=registered files=%d bytes=%d runs_per_block_max=%d",
             len(used), hw.pinned_bytes, max((len(b) for b in runs), default=0))
    return hw


# [Note: pin what is read]
# Registering a file the page cache does not hold makes the driver read it whole while it pins it,
# and the pinning holds the process's memory map meanwhile: on the H200 a checkpoint-cold Wan2.1
# start spent 20-25 s in imports or in building the models, whichever ran beside the pinning of
# cold files, though those files were cached (`ready-h200-2026-12-02-i`: imports 22.6 s against
# 1.5 s warm; every `mmap` of a library or an allocation waits for the map). So on a cold start the
# registration pins each file only once the readahead child has read it (`ReadFront.until_resident`):
# the disk is read by the child at its speed, the pinning of cached pages is short (~1.5 s for the
# whole 40 GB warm), and the rank's imports and builds go on beside.
