"""The slot prefetcher: two device slots, three streams, and the order blocks are gathered in.

Owns: `SlotPrefetcher` (the two slots, the three streams and their events, the order gathers are
issued in and its checks, bind = point a block's parameters at its slot views, the per-block
schedule that runs before and after each block, the gather counters), the wait-timing ring,
`PrefetchOrderError`, and the planned schedule of a request with a step cache (`plan`: only the
blocks some rank of the shard group runs are gathered, [Note: planned gathers] in
`dlo.engine.skip_plan`). How a gather moves the bytes (eager H2D and AllGather, CUDA-graph replay,
peer pulls) is the `BlockTransfer` that `dlo.engine.load` chose (`dlo.engine.transfers`); what
runs once they have landed (FP8 streaming: the dequantization) is the step beside it.
Must never: synchronise the host in the hot path, branch on the transfer strategy, attach itself
to a module (`dlo.engine.hooks` does that), or let a rank issue gathers in a different order from
its shard group.

Data path, per offloaded block b (docs/contracts.md sections 3 and 4):

    arena shard (pinned host) --H2D, copy stream--> slot[k].narrow(r*S, S)
                              --in-place AllGather, comm stream--> slot[k][0 : g*S]
    compute stream waits `ready[k]`, binds b's cached views of slot[k], runs b, records `free[k]`

The i-th gather since load uses slot i % 2. While block b computes from one slot, block b+1 is
gathered into the other; the last block prefetches the first for the next call, so a call never
starts cold. The host never synchronises in this loop; per-block host work is a few dict writes and
two or three launches.

[Note: stream lifetimes]
Three rules keep the two slots safe without host synchronisation (rules 1 and 2 are applied by
every `BlockTransfer.issue` in `dlo.engine.transfers`, rule 3 by `before_block`):
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
sequence without compute. Under a `plan` (a wave with a step cache) the sequence is the blocks the
plan's agreed `gathers` name, the same on every rank; a gather in flight that the plan no longer
needs is released unread (`_waste`), and the first gathered block of a call is issued at its turn
where nothing was gathered ahead (a planned call prefetches no next call, but where the rank
gathers alone and the block always runs), so a call never starts with another rank's order. A block called out of order (a forward that failed mid-way) breaks the
prefetcher for good: `PrefetchOrderError`, and the engine must restart (collectives may be in flight).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from dlo.engine.dtypes import torch_dtype
from dlo.engine.layout import BlockLayout
from dlo.engine.model import owner_of
from dlo.engine.platform import Platform
from dlo.engine.report import GatherStats
from dlo.engine.settings import OffloadSettings
from dlo.engine.fp8 import DequantPiece, scale_name
from dlo.engine.skip_plan import CallPlan
from dlo.engine.transfers import BlockTransfer, Dequantize, Lanes, NoStep, SlotPlan


def profiling() -> bool:
    """Whether a profiler is recording: `record_function` ranges cost nothing unless it is."""
    return torch.autograd.profiler._is_profiler_enabled


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
    dequant: tuple[DequantPiece, ...] = ()  # FP8 streaming: its FP8 weights (dlo.engine.fp8)


class SlotPrefetcher:
    """Two device slots, three streams, and the per-block schedule (`before_block`, `after_block`)."""

    def __init__(
        self,
        root: nn.Module,
        blocks: list[OffloadedBlock],
        copies: list[list[tuple[torch.Tensor, int]]],
        *,
        transfer: BlockTransfer,
        settings: OffloadSettings,
        platform: Platform,
        device: torch.device,
        g: int,
        r: int,
        group: Any = None,
    ):
        """`transfer` as `dlo.engine.load` chose it (`dlo.engine.transfers.choose_transfer`) for the
        `g` ranks sharing the weights (this one is `r`; g = 1 without a collective); `settings` as
        load resolved them (`time_waits`: time the compute stream's waits on stream platforms)."""
        self.root = root
        self.blocks = blocks
        self.copies = copies  # per block: (host bytes, offset in this rank's shard)
        self.platform = platform
        self.g, self.r = g, r
        self.group = group  # the shard group (None: the default group); a plan's exchange runs over its ranks
        self.slot_bytes = max(b.shard * g for b in blocks)
        self.lanes = Lanes.create(platform)
        self.compute_stream, self.ready, self.free = self.lanes.compute, self.lanes.ready, self.lanes.free
        plan = SlotPlan(copies, [b.shard for b in blocks], g, r, device, self.slot_bytes)
        self.slots = transfer.attach(self.lanes, plan)
        # what runs once a block has landed: its FP8 weights dequantized ([Note: where FP8 is dequantized])
        self.landed = Dequantize([b.dequant for b in blocks], self.slots, device) if any(
            b.dequant for b in blocks) else NoStep()
        # device bytes the streaming holds: the two slots and the dequant buffer
        self.device_bytes = 2 * self.slot_bytes + self.landed.device_bytes
        self._n = 0  # gathers issued since load: gather n fills slot n % 2
        # the gather counters (`stats`), per block what one gather adds
        self._gathers = self._h2d_bytes = self._collective_bytes = self._not_streamed = 0
        self.wasted = 0  # gathers issued ahead that a step cache's decision then made unneeded on every rank
        self._wait_seconds = 0.0
        self._received = [b.shard * (g - 1) if transfer.receives else 0 for b in blocks]
        self._init_wait_timing(settings.time_waits)
        for j, b in enumerate(blocks):
            b.binds = [self._views(b, s, self._dequant_views(j)) for s in self.slots]
        self._event = 0  # the block whose turn is next (its pre-hook)
        self._inflight: int | None = 0  # the block whose gather is in flight (None: none)
        self._cur = 0  # slot holding (or receiving) that block
        self._running: int | None = None  # slot of the block running now (its post-hook frees it)
        self.live: int | None = None  # the block bound for this turn (None: skipped by a step cache)
        self.plan: CallPlan | None = None  # a step cache's plan of the calls ([Note: planned gathers])
        self.broken: str | None = None
        # CFG pairs ([Note: CFG pairs] in dlo.engine.cfg_pairs): the lane running now, None unpaired.
        # Lane 0 waits for a block's slot, binds it and gathers the next; lane 1 runs the same
        # block from the slot lane 0 bound, then frees it.
        self.lane: int | None = None
        # Block 0 is gathered eagerly first whatever the transfer: NCCL must set up its communicator
        # outside graph capture, and the next call starts from it. Then the transfer every later
        # gather uses (transfer graphs are captured here), fixed for the model's life.
        self.transfer = transfer.eager
        self._issue(0)
        self.transfer = transfer.start()

    def _init_wait_timing(self, time_waits: bool) -> None:
        platform = self.platform
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
        # without streams every gather is synchronous: its host time is the wait
        self._timed = not platform.has_streams

    def _dequant_views(self, j: int) -> dict[str, torch.Tensor]:
        return self.landed.views[j] if self.landed.views else {}

    def _views(self, b: OffloadedBlock, slot: torch.Tensor,
               dequantized: dict[str, torch.Tensor]) -> list[tuple[dict, str, torch.Tensor]]:
        """What block b's tensors bind to in `slot`: a view of its bytes there, or for an FP8 weight
        its view of the dequant buffer (its scales bind to nothing)."""
        out = []
        scales = {scale_name(p.name) for p in b.dequant}
        for t in b.layout.tensors:
            if t.name in scales:
                continue
            view = dequantized.get(t.name)
            if view is None:
                view = slot[t.offset : t.end].view(torch_dtype(t.dtype)).view(t.shape)
            owner, attr, is_param = owner_of(self.root, t.name)
            out.append((owner._parameters if is_param else owner._buffers, attr, view))
        return out

    @property
    def stats(self) -> GatherStats:
        """The counters so far (wait timings folded in by `collect_waits`)."""
        return GatherStats(self._gathers, self._h2d_bytes, self._collective_bytes, self._wait_seconds,
                           bytes_not_streamed=self._not_streamed)

    def release(self) -> None:
        """After in-flight work, release what the transfer holds (transfer graphs, which NCCL needs
        gone before the group is left; the peer gathers' mappings of the other ranks' slots)."""
        self.transfer.release()

    # ---- the hot path ----------------------------------------------------------------------------
    def _issue(self, i: int) -> None:
        if profiling():
            with record_function("dlo::gather"):
                return self._issue_any(i)
        return self._issue_any(i)

    def _issue_any(self, i: int) -> None:
        """Gather n (block i into slot n % 2) through the transfer, and count it."""
        n, self._n = self._n, self._n + 1
        k = n % 2
        t0 = time.perf_counter() if self._timed else 0.0
        try:
            self.transfer.issue(i, k, n)
        except BaseException as e:  # a gather that raised (a broken collective) leaves the order unknown
            self.broken = f"the gather of block {i} failed: {type(e).__name__}: {e}; restart the engine"
            raise
        self._inflight, self._cur = i, k
        self._gathers += 1
        self._h2d_bytes += self.blocks[i].shard
        self._collective_bytes += self._received[i]
        if self._timed:
            self._wait_seconds += time.perf_counter() - t0

    def before_block(self, i: int) -> None:
        """Wait for block i's slot, bind it, gather the next block ([Note: collective order]: loud
        `PrefetchOrderError` when i is not the block expected); under a `plan`, as it says."""
        if self.broken is not None:
            raise PrefetchOrderError(self.broken)
        if i != self._event:
            self.broken = (
                f"block {i} ran but block {self._event} was expected: a forward stopped mid-way "
                "and gathers are in flight; restart the engine"
            )
            raise PrefetchOrderError(self.broken)
        self._event = i + 1 if i + 1 < len(self.blocks) else 0
        if self.plan is not None:
            return self._before_planned(i, self.plan)
        if self._inflight != i:  # nothing gathered ahead (a planned call came before): every rank gathers it now
            if self._inflight is not None:
                self._waste()
            self._issue(i)
        self._bind_landed(i)
        self._issue(self._event)

    def _bind_landed(self, i: int) -> None:
        """Block i's gather (in flight in slot k): the compute stream waits for it, binds the block."""
        k = self._cur
        if self._wait_ring:
            self._timed_wait(k)
        else:
            self.platform.wait(self.compute_stream, self.ready[k])  # rule 3
        self.landed.run(i, k)
        blk = self.blocks[i]
        if blk.bound != k:
            if profiling():
                with record_function("dlo::bind"):
                    self._bind(blk, k)
            else:
                self._bind(blk, k)
        self._inflight, self._running, self.live = None, k, i

    def _before_planned(self, i: int, plan: CallPlan) -> None:
        """Block i's turn under a step cache's plan ([Note: planned gathers]): gathered where some rank
        runs it, bound where this one does, and the next gathered block issued."""
        plan.at(i)
        streamed = self._inflight == i
        if self._inflight is not None and not plan.gathers[self._inflight]:
            self._waste()  # the look-ahead of a block the cache then skipped
        self._running = self.live = None
        if plan.gathers[i]:
            if self._inflight != i:  # not gathered ahead (a call's first): gathered now, by every rank
                if self._inflight is not None:
                    self._waste()
                self._issue(i)
            if plan.runs(i):
                self._bind_landed(i)
            else:  # another rank runs it: this one took part in the gather and reads nothing
                self._waste(counted=False)
        elif not streamed:
            self._not_streamed += self.blocks[i].shard + self._received[i]
        if self._inflight is None:
            nxt = plan.next_gathered(i)
            if nxt is None and plan.prefetch_next_call:
                nxt = 0
            if nxt is not None:
                self._issue(nxt)

    def _waste(self, counted: bool = True) -> None:
        """The gather in flight is not read on this rank: its slot is free once the gather is done (the
        stream that finishes it records `free`, so a later gather into the slot waits for it)."""
        lanes = self.lanes
        self.platform.record(self.free[self._cur], lanes.comm if self.transfer.receives else lanes.copy)
        self._inflight = None
        self.wasted += counted

    @property
    def inflight(self) -> int | None:
        """The block whose gather is in flight (gathered ahead of its turn); None: none."""
        return self._inflight

    @property
    def between_forwards(self) -> bool:
        """True when no forward stopped mid-way: the next call may start at block 0 (or
        `gather_only`) and every rank of the shard group is still at the same place in the order."""
        return self.broken is None and self._event == 0

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
                self._wait_seconds += sec
                done += 1
            if done:
                del pending[:done]

    def after_block(self) -> None:
        if self._running is not None:  # None: the block was not bound on this rank (a step cache skipped it)
            self.platform.record(self.free[self._running], self.compute_stream)
            self._running = None

    def gather_only(self) -> None:
        """Walk one forward's gathers without compute (idle rank in a partial wave; the same
        sequence as a forward, see [Note: collective order])."""
        for i in range(len(self.blocks)):
            self.before_block(i)
            self.after_block()
