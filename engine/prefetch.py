"""The slot prefetcher: two device slots, three streams, and the order blocks are gathered in.

Owns: `SlotPrefetcher` (gather = H2D + in-place AllGather of a block into a slot, bind = point a
block's parameters at its slot views, the per-block schedule that runs before and after each
block), the gather function (`make_gather`), the wait-timing ring, and `PrefetchOrderError`.
Must never: synchronise the host in the hot path, attach itself to a module (`dlo.engine.hooks`
does that), or let a rank issue gathers in a different order from its shard group.

Data path, per offloaded block b (CONTRACTS.md sections 3 and 4):

    arena shard (pinned host) --H2D, copy stream--> slot[k].narrow(r*S, S)
                              --in-place AllGather, comm stream--> slot[k][0 : g*S]
    compute stream waits `ready[k]`, binds b's cached views of slot[k], runs b, records `free[k]`

The i-th gather since load uses slot i % 2. While block b computes from one slot, block b+1 is
gathered into the other; the last block prefetches the first for the next call, so a call never
starts cold. The host never synchronises in this loop; per-block host work is a few dict writes and
two or three launches.

[Note: stream lifetimes]
Three rules keep the two slots safe without host synchronisation:
1. The copy stream waits `free[k]` before overwriting slot k: `free[k]` is recorded on the compute
   stream after the last block that read slot k, so no kernel still reads the bytes being replaced.
2. The comm stream waits `h2d[k]` before gathering slot k: the rank's own shard must have landed.
3. The compute stream waits `ready[k]` before the block that reads slot k.
Slots and the arena are allocated once and never freed while the model lives, so no allocator
`record_stream` bookkeeping is needed. Waiting on an event never recorded is a no-op (the first
gathers). On CPU every call is synchronous and the events are no-ops: the same code runs.

[Note: collective order]
Every rank of a shard group must issue the same gathers in the same order. Each rank runs blocks in
execution order; a rank without work in a wave calls `gather_only(n_calls)`, which walks the same
sequence without compute. A block called out of order (a forward that failed mid-way) breaks the
prefetcher for good: `PrefetchOrderError`, and the engine must restart (collectives may be in flight).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from dlo.engine.dtypes import torch_dtype
from dlo.engine.layout import BlockLayout
from dlo.engine.model import owner_of
from dlo.engine.peergather import PeerGather
from dlo.engine.platform import Platform
from dlo.engine.report import GatherStats
from dlo.engine.settings import OffloadSettings

log = logging.getLogger(__name__)


def profiling() -> bool:
    """Whether a profiler is recording: `record_function` ranges cost nothing unless it is."""
    return torch.autograd.profiler._is_profiler_enabled


def make_gather(group: Any) -> Any:
    """In-place AllGather `fn(out, shard)` with the argument checks done once, not per block.

    The public `all_gather_into_tensor` (renamed `all_gather_single` in torch 2.13) re-validates
    its arguments and looks the group up on every call: ~100 us of Python per block. The shapes
    here are fixed at load, so the hot path calls the process group's base allgather directly.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    base = getattr(pg, "_allgather_base", None)
    if base is None:  # pragma: no cover - older/other torch builds
        public = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda out, shard: public(out, shard, group=group)
    opts = dist.distributed_c10d.AllgatherOptions()

    def gather(out: torch.Tensor, shard: torch.Tensor) -> None:
        base(out, shard, opts).wait()

    return gather


WAIT_RING = 256
class PrefetchOrderError(RuntimeError):
    """The prefetcher lost its block order; the engine must restart (collectives may be in flight)."""


@dataclass
class OffloadedBlock:
    """One streamed block: its module, slot layout, shard size and cached bindings per slot."""

    module: nn.Module
    layout: BlockLayout
    shard: int  # S
    # per slot: [(owner._parameters or _buffers dict, attribute, view)] - the cached binding
    binds: list[list[tuple[dict, str, torch.Tensor]]] = field(default_factory=list)
    bound: int = -1  # slot currently bound


class SlotPrefetcher:
    """Two device slots, three streams, and the per-block schedule (`before_block`, `after_block`)."""

    def __init__(
        self,
        root: nn.Module,
        blocks: list[OffloadedBlock],
        copies: list[list[tuple[torch.Tensor, int]]],
        *,
        settings: OffloadSettings,
        platform: Platform,
        device: torch.device,
        group: Any,
        g: int,
        r: int,
    ):
        """`settings` as `dlo.engine.load` resolved them for this model: `mode` allgather gathers over
        the `g` ranks of `group` (this one is `r`); `transfer` peer rebuilds blocks by peer copies
        (dlo.engine.peergather), only for allgather over g > 1 ranks; `transfer_graphs` None: on cuda."""
        collective = settings.mode == "allgather"
        peer = settings.transfer == "peer"
        if peer and not (collective and g > 1):
            raise ValueError("peer gathers need allgather over more than one rank")
        graphs = platform.name == "cuda" if settings.transfer_graphs is None else settings.transfer_graphs
        time_waits = settings.time_waits
        self.root = root
        self.blocks = blocks
        self.copies = copies  # per block: (host bytes, offset in this rank's shard)
        self.platform = platform
        self.g, self.r, self.collective = g, r, collective
        self.slot_bytes = max(b.shard * g for b in blocks)
        self.copy_stream = platform.new_stream("copy")
        self.comm_stream = platform.new_stream("comm")
        self.compute_stream = platform.current_stream()
        self.h2d = [platform.new_event() for _ in range(2)]
        self.ready = [platform.new_event() for _ in range(2)]
        self.free = [platform.new_event() for _ in range(2)]
        # peer gathers (dlo.engine.peergather): the slots are shared with the shard group's ranks,
        # which copy each other's shards out of them instead of running the collective
        self._peer = (PeerGather(group=group, g=g, r=r, device=device, slot_bytes=self.slot_bytes,
                                 copy_stream=self.copy_stream, comm_stream=self.comm_stream)
                      if peer else None)
        self.slots = (self._peer.slots if self._peer is not None else
                      [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)])
        self._gather = make_gather(group) if collective and self._peer is None else None
        self._n = 0  # gathers issued since load: gather n fills slot n % 2
        self.stats = GatherStats()
        # ring of timing-event pairs around the compute stream's waits (streams only)
        self._wait_ring = (
            [(platform.new_event(True), platform.new_event(True)) for _ in range(WAIT_RING)]
            if platform.has_streams and time_waits else []
        )
        self._wait_pending: list[int] = []
        self._wait_next = 0
        # collect_waits runs on the compute thread (ring full) and from stats() on any thread
        # (serving's progress watchdog): one fold at a time, or a pair would count twice.
        self._wait_lock = threading.Lock()
        self._timed = not platform.has_streams
        self._slot_in = [
            [s.narrow(0, r * b.shard, b.shard) for s in self.slots] for b in blocks
        ]
        self._slot_out = [[s[: g * b.shard] for s in self.slots] for b in blocks]
        for b in blocks:
            b.binds = [self._views(b, s) for s in self.slots]
        self._expected = 0  # index of the block whose gather is in flight
        self._cur = 0  # slot holding (or receiving) that block
        self._running = 0
        self.broken: str | None = None
        self._graphs: list[list[Any]] | None = None
        # Block 0 is gathered eagerly first either way: NCCL must set up its communicator outside
        # graph capture, and the next call starts from it.
        self._issue(0, 0)
        if graphs and self._peer is not None:
            log.info("transfer graphs off: peer gathers are issued eagerly (a host handshake per gather)")
        elif graphs:
            self._capture_graphs()

    def _views(self, b: OffloadedBlock, slot: torch.Tensor) -> list[tuple[dict, str, torch.Tensor]]:
        out = []
        for t in b.layout.tensors:
            view = slot[t.offset : t.end].view(torch_dtype(t.dtype)).view(t.shape)
            owner, attr, is_param = owner_of(self.root, t.name)
            out.append((owner._parameters if is_param else owner._buffers, attr, view))
        return out

    # ---- the hot path ----------------------------------------------------------------------------
    def _capture_graphs(self) -> None:
        """Capture each (block, slot) transfer as CUDA graphs: its H2D runs as one graph on the copy
        stream and its in-place AllGather as one on the comm stream, one launch each instead of one
        per run plus the collective's Python and bookkeeping. Two graphs, not one: the next block's
        H2D (PCIe) then overlaps this block's AllGather (NVLink) instead of queueing behind it on
        one stream, so a block's transfer costs max(H2D, AllGather), not their sum (bench/NOTES.md 6)."""
        p = self.platform
        try:
            p.synchronize()  # block 0's eager gather (issued first) is complete before capture
            graphs = []
            for i in range(len(self.blocks)):
                per_slot = []
                for k in range(2):
                    copy = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(copy, stream=self.copy_stream, capture_error_mode="thread_local"):
                        self._copy_in(i, k)
                    gather = None
                    if self._gather is not None:
                        gather = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(gather, stream=self.comm_stream, capture_error_mode="thread_local"):
                            self._gather(self._slot_out[i][k], self._slot_in[i][k])
                    per_slot.append((copy, gather))
                graphs.append(per_slot)
            p.synchronize()
            self._graphs = graphs
        except Exception as e:  # capture unsupported here: stay eager, say so
            log.warning("transfer graphs unavailable (%s: %s); using eager transfers", type(e).__name__, e)
            self._graphs = None

    @property
    def transfer(self) -> str:
        """How blocks move (`LoadReport.transfer`): "peer", "graph" or "eager"."""
        return "peer" if self._peer is not None else "graph" if self._graphs is not None else "eager"

    def release(self) -> None:
        """After in-flight work, drop the transfer graphs (NCCL cannot tear a communicator down while
        graphs holding its collectives are alive, so this comes before leaving the group) or the peer
        gathers' mappings of the other ranks' slots."""
        if self._graphs is None and self._peer is None:
            return
        self.platform.synchronize()
        self._graphs = None
        if self._peer is not None:
            self._peer.close()

    def _copy_in(self, i: int, k: int) -> None:
        """H2D this rank's bytes of block i into its part of slot k, on the current stream."""
        dst = self._slot_in[i][k]
        for src, off in self.copies[i]:
            dst[off : off + src.numel()].copy_(src, non_blocking=True)

    def _count(self, i: int) -> None:
        shard = self.blocks[i].shard
        self.stats.gathers += 1
        self.stats.h2d_bytes += shard
        if self.collective:
            self.stats.collective_bytes += shard * (self.g - 1)

    def _issue(self, i: int, k: int) -> None:
        if profiling():
            with record_function("dlo::gather"):
                return self._issue_any(i, k)
        return self._issue_any(i, k)

    def _issue_any(self, i: int, k: int) -> None:
        n, self._n = self._n, self._n + 1
        if self._graphs is None:
            return self._issue_eager(i, k, n)
        p = self.platform
        copy, gather = self._graphs[i][k]
        p.set_stream(self.copy_stream)
        p.wait(self.copy_stream, self.free[k])  # [Note: stream lifetimes] rule 1
        copy.replay()
        if gather is None:
            p.record(self.ready[k], self.copy_stream)
        else:
            p.record(self.h2d[k], self.copy_stream)
            p.set_stream(self.comm_stream)
            p.wait(self.comm_stream, self.h2d[k])  # rule 2
            gather.replay()
            p.record(self.ready[k], self.comm_stream)
        p.set_stream(self.compute_stream)
        self._count(i)

    def _issue_eager(self, i: int, k: int, n: int) -> None:
        """Gather n (block i into slot k), asynchronously where the platform has streams: H2D, then
        the collective or the peer copies ([Note: peer handshake] in dlo.engine.peergather)."""
        p, peer = self.platform, self._peer
        t0 = time.perf_counter() if self._timed else 0.0
        try:
            p.set_stream(self.copy_stream)
            p.wait(self.copy_stream, self.free[k])  # [Note: stream lifetimes] rule 1
            if peer is not None:
                peer.before_h2d(n, k)  # and no peer still reads this rank's part of slot k
            self._copy_in(i, k)
            # without a second stage the block is ready as soon as its bytes have landed
            second = self._gather is not None or peer is not None
            p.record(self.h2d[k] if second else self.ready[k], self.copy_stream)
            if second:
                if peer is not None:
                    peer.after_h2d(n, k)
                p.set_stream(self.comm_stream)
                p.wait(self.comm_stream, self.h2d[k])  # rule 2
                if peer is not None:
                    peer.pull(n, k, self.blocks[i].shard)
                else:
                    self._gather(self._slot_out[i][k], self._slot_in[i][k])
                p.record(self.ready[k], self.comm_stream)
        finally:  # a gather that raised (a broken collective, a peer gone) leaves the compute stream current
            p.set_stream(self.compute_stream)
        self._count(i)
        if self._timed:
            self.stats.gather_wait_seconds += time.perf_counter() - t0

    def before_block(self, i: int) -> None:
        """Wait for block i's slot, bind it, gather the next block ([Note: collective order]: loud
        `PrefetchOrderError` when i is not the block expected)."""
        if self.broken is not None:
            raise PrefetchOrderError(self.broken)
        if i != self._expected:
            self.broken = (
                f"block {i} ran but block {self._expected} was expected: a forward stopped mid-way "
                "and gathers are in flight; restart the engine"
            )
            raise PrefetchOrderError(self.broken)
        k = self._cur
        if self._wait_ring:
            self._timed_wait(k)
        else:
            self.platform.wait(self.compute_stream, self.ready[k])  # rule 3
        blk = self.blocks[i]
        if blk.bound != k:
            if profiling():
                with record_function("dlo::bind"):
                    self._bind(blk, k)
            else:
                self._bind(blk, k)
        nxt = i + 1 if i + 1 < len(self.blocks) else 0
        try:
            self._issue(nxt, 1 - k)
        except BaseException as e:  # a gather that raised (a broken collective) leaves the order unknown
            self.broken = f"the gather of block {nxt} failed: {type(e).__name__}: {e}; restart the engine"
            raise
        self._expected, self._cur, self._running = nxt, 1 - k, k

    @property
    def between_forwards(self) -> bool:
        """True when no forward stopped mid-way: the next call may start at block 0 (or
        `gather_only`) and every rank of the shard group is still at the same place in the order."""
        return self.broken is None and self._expected == 0

    @staticmethod
    def _bind(blk: OffloadedBlock, k: int) -> None:
        for d, attr, view in blk.binds[k]:
            d[attr] = view
        blk.bound = k

    def _timed_wait(self, k: int) -> None:
        """Rule 3 with timing events around it; a slot whose pair is still in flight goes untimed."""
        p, cs = self.platform, self.compute_stream
        j = self._wait_next
        full = len(self._wait_ring)  # pending holds ring slots in order: full means j is pending
        if len(self._wait_pending) == full:
            self.collect_waits()
        if len(self._wait_pending) == full:  # still in flight: skip timing rather than synchronise
            p.wait(cs, self.ready[k])
            return
        start, end = self._wait_ring[j]
        p.record(start, cs)
        p.wait(cs, self.ready[k])
        p.record(end, cs)
        self._wait_pending.append(j)
        self._wait_next = (j + 1) % len(self._wait_ring)

    def collect_waits(self) -> None:
        """Fold completed wait timings into the stats (non-blocking). Pairs complete in the order
        they were recorded on the compute stream, so the scan stops at the first one in flight."""
        with self._wait_lock:
            pending = self._wait_pending
            done = 0
            for j in pending:
                sec = self.platform.elapsed_seconds(*self._wait_ring[j])
                if sec is None:
                    break
                self.stats.gather_wait_seconds += sec
                done += 1
            if done:
                del pending[:done]

    def after_block(self) -> None:
        self.platform.record(self.free[self._running], self.compute_stream)

    def gather_only(self) -> None:
        """Walk one forward's gathers without compute (idle rank in a partial wave; the same
        sequence as a forward, see [Note: collective order])."""
        for i in range(len(self.blocks)):
            self.before_block(i)
            self.after_block()
