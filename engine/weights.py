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
Must never: register or pin per tensor, or fall back silently (the choice and why are logged and
reported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch

from dlo.engine.arena import build_arena
from dlo.engine.checkpoint import Checkpoint
from dlo.engine.layout import BlockLayout, shard_pieces
from dlo.engine.platform import Platform

log = logging.getLogger(__name__)

WeightsChoice = Literal["auto", "arena", "registered"]
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
) -> HostWeights:
    if prefer not in ("auto", "arena", "registered"):
        raise ValueError(f"weights must be auto, arena or registered; got {prefer!r}")
    reason = ""
    if prefer != "arena":
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
            hw = _register(ckpt, runs, platform)
            if hw is not None:
                return hw
            reason = "the platform refused to register the file mappings"
        if prefer == "registered":
            raise RuntimeError(f"weights 'registered' not possible: {reason}")
    arena = build_arena(ckpt, layouts, target_dtype, g, r, platform)
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


def _register(ckpt: Checkpoint, runs: list[list[Run]], platform: Platform) -> HostWeights | None:
    used = sorted({run.path for block in runs for run in block})
    registered: list[tuple[int, int]] = []
    if platform.has_streams:
        for path in used:
            whole = ckpt.file_bytes(path)
            if not platform.register_read_only(whole.data_ptr(), whole.numel()):
                for ptr, _ in registered:
                    platform.unregister(ptr)
                return None
            registered.append((whole.data_ptr(), whole.numel()))
    copies = [[(ckpt.file_bytes(run.path)[run.start : run.start + run.n], run.dst) for run in block] for block in runs]
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
