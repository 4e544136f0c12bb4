"""Transfers: how one gather moves a block's bytes into a slot, as objects behind one small interface.

Owns: `BlockTransfer` (what the slot prefetcher calls: `attach`, `eager`, `start`, `issue`,
`release`), its strategies `EagerTransfer` (this rank's H2D on the copy stream, nothing more: rank-local),
`CollectiveTransfer` (then the in-place AllGather on the comm stream), `GraphTransfer` (either of
them captured as CUDA graphs and replayed) and `PeerTransfer` (the H2D, then copy-engine pulls out
of the peers' slots under `dlo.engine.peergather`'s handshake), `choose_transfer` (the one choice,
made by `dlo.engine.load` from the resolved `OffloadSettings`), `Lanes` (the streams and per-slot
events a prefetcher's transfers run on), `SlotPlan` (what they move), `make_gather`, and the step
every strategy shares once a block's bytes have landed: `Dequantize` (FP8 streaming: the block's FP8
weights into one compute-dtype buffer, `[Note: where FP8 is dequantized]`) or `NoStep`.
FSDP2's pluggable all-gather (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`) is the
model: the transfer is chosen once and the prefetcher's hot loop never branches on it.
Must never: synchronise the host in `issue`, order, bind or time blocks (`dlo.engine.prefetch`
does: the slots' lifetimes, `[Note: stream lifetimes]`, and the order, `[Note: collective order]`,
are explained there), or let a rank overwrite its part of a slot a peer may still read
(`[Note: peer handshake]` in `dlo.engine.peergather`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from dlo.engine.fp8 import DequantPiece, dequant_bytes
from dlo.engine.peergather import PeerGather
from dlo.engine.platform import Platform
from dlo.engine.quantize import dequantize_into
from dlo.engine.settings import OffloadSettings

log = logging.getLogger(__name__)


def make_gather(group: Any) -> Callable[[torch.Tensor, torch.Tensor], None]:
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


@dataclass(frozen=True)
class Lanes:
    """The three streams of one prefetcher and its events per slot, made once
    ([Note: stream lifetimes] in `dlo.engine.prefetch` says who records and who waits)."""

    platform: Platform
    copy: Any  # H2D of this rank's bytes
    comm: Any  # the collective, or the peer pulls
    compute: Any  # the blocks (the stream current at load)
    h2d: tuple[Any, Any]  # this rank's part of slot k has landed
    ready: tuple[Any, Any]  # slot k holds the whole block
    free: tuple[Any, Any]  # the last block reading slot k has run

    @classmethod
    def create(cls, platform: Platform) -> "Lanes":
        copy, comm, compute = platform.new_stream("copy"), platform.new_stream("comm"), platform.current_stream()
        h2d, ready, free = ((platform.new_event(), platform.new_event()) for _ in range(3))
        return cls(platform, copy, comm, compute, h2d, ready, free)


@dataclass(frozen=True)
class SlotPlan:
    """What a transfer moves, fixed at load: per streamed block, this rank's host runs and its shard
    size S; the shard group (g ranks, this one r; g = 1 without a collective)."""

    copies: list[list[tuple[torch.Tensor, int]]]  # per block: (host bytes, offset in this rank's shard)
    shards: list[int]  # per block: S
    g: int
    r: int
    device: torch.device
    slot_bytes: int  # the largest block's g x S


class BlockTransfer:
    """One way of moving gather n (block i into slot k) onto the device, asynchronously where the
    platform has streams. The prefetcher calls `attach` once, gathers block 0 with `eager`, then
    uses what `start` returns for every later gather, and `release` at close."""

    name: ClassVar[str] = ""  # `LoadReport.transfer`: "eager", "graph" or "peer"
    receives: bool = False  # gathers bring the other ranks' bytes (`GatherStats.collective_bytes`)

    def attach(self, lanes: Lanes, plan: SlotPlan) -> list[torch.Tensor]:
        """Allocate the two slots (FSDP2's `AllGather.allocate`: peers share theirs) and keep what
        `issue` moves bytes through; returns the slots."""
        raise NotImplementedError

    @property
    def eager(self) -> "BlockTransfer":
        """What gathers block 0 at load, before `start` (NCCL sets its communicator up outside any
        graph capture)."""
        return self

    def start(self) -> "BlockTransfer":
        """The transfer of every later gather, once block 0's gather is issued."""
        return self

    def issue(self, i: int, k: int, n: int) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """After in-flight work: drop what outlives a call (graphs, peer mappings)."""


class EagerTransfer(BlockTransfer):
    """This rank's H2D into its part of the slot, then the second stage (`exchange`) where the
    transfer `receives` other ranks' bytes; without one (rank-local) the block is ready once its
    bytes have landed."""

    name = "eager"

    def attach(self, lanes: Lanes, plan: SlotPlan) -> list[torch.Tensor]:
        self.lanes, self.plan = lanes, plan
        slots = self._allocate()
        self._into = [[s.narrow(0, plan.r * shard, shard) for s in slots] for shard in plan.shards]
        self._out = [[s[: plan.g * shard] for s in slots] for shard in plan.shards]
        return slots

    def _allocate(self) -> list[torch.Tensor]:
        return [torch.empty(self.plan.slot_bytes, dtype=torch.uint8, device=self.plan.device) for _ in range(2)]

    def copy_in(self, i: int, k: int) -> None:
        """H2D this rank's bytes of block i into its part of slot k, on the current stream."""
        dst = self._into[i][k]
        for src, off in self.plan.copies[i]:
            dst[off : off + src.numel()].copy_(src, non_blocking=True)

    def exchange(self, i: int, k: int, n: int) -> None:
        """The second stage of gather n, on the current (comm) stream (only where `receives`)."""
        raise NotImplementedError

    def _before_h2d(self, n: int, k: int) -> None:
        pass

    def _after_h2d(self, n: int, k: int) -> None:
        pass

    def issue(self, i: int, k: int, n: int) -> None:
        lanes = self.lanes
        p = lanes.platform
        try:
            p.set_stream(lanes.copy)
            p.wait(lanes.copy, lanes.free[k])  # [Note: stream lifetimes] rule 1
            self._before_h2d(n, k)
            self.copy_in(i, k)
            if not self.receives:  # no second stage: the block is ready once its bytes have landed
                p.record(lanes.ready[k], lanes.copy)
                return
            p.record(lanes.h2d[k], lanes.copy)
            self._after_h2d(n, k)
            p.set_stream(lanes.comm)
            p.wait(lanes.comm, lanes.h2d[k])  # rule 2
            self.exchange(i, k, n)
            p.record(lanes.ready[k], lanes.comm)
        finally:  # a gather that raised (a broken collective, a peer gone) leaves the compute stream current
            p.set_stream(lanes.compute)


class CollectiveTransfer(EagerTransfer):
    """The eager transfer whose second stage is the in-place AllGather of the slot (`make_gather`)."""

    receives = True

    def __init__(self, gather: Callable[[torch.Tensor, torch.Tensor], None]):
        self._gather = gather

    def exchange(self, i: int, k: int, n: int) -> None:
        self._gather(self._out[i][k], self._into[i][k])


class PeerTransfer(EagerTransfer):
    """The eager transfer whose second stage pulls the peers' shards out of their slots (copy
    engines, no kernel; `dlo.engine.peergather`), each step under [Note: peer handshake]."""

    name = "peer"
    receives = True
    peer: PeerGather  # made with the slots (`attach`)

    def __init__(self, group: Any):
        self._group = group

    def _allocate(self) -> list[torch.Tensor]:
        # the slots are shared with the shard group's ranks, which copy each other's shards out of them
        plan = self.plan
        self.peer = PeerGather(group=self._group, g=plan.g, r=plan.r, device=plan.device,
                               slot_bytes=plan.slot_bytes, copy_stream=self.lanes.copy, comm_stream=self.lanes.comm)
        return self.peer.slots

    def _before_h2d(self, n: int, k: int) -> None:
        self.peer.before_h2d(n, k)  # a(n): no peer still reads this rank's part of slot k

    def _after_h2d(self, n: int, k: int) -> None:
        self.peer.after_h2d(n, k)  # a(n): this rank's part is on its way

    def exchange(self, i: int, k: int, n: int) -> None:
        self.peer.pull(n, k, self.plan.shards[i])  # b(n)

    def release(self) -> None:
        self.lanes.platform.synchronize()  # this rank reads nothing any more
        self.peer.close()


class GraphTransfer(BlockTransfer):
    """An eager transfer captured per (block, slot) as CUDA graphs: its H2D as one graph on the copy
    stream, its in-place AllGather as one on the comm stream, one launch each instead of one per run
    plus the collective's Python and bookkeeping. Two graphs, not one: the next block's H2D (PCIe)
    then overlaps this block's AllGather (NVLink) instead of queueing behind it on one stream, so a
    block's transfer costs max(H2D, AllGather), not their sum (record `h200x2-2026-11-30`)."""

    name = "graph"

    def __init__(self, eager: EagerTransfer):
        if isinstance(eager, PeerTransfer):  # a host handshake per gather: nothing to capture
            raise ValueError("peer gathers are issued eagerly; they have no transfer graphs")
        self._eager = eager
        self.receives = eager.receives
        self._graphs: list[list[tuple[Any, Any]]] = []  # per block and slot: (H2D, AllGather or None)

    def attach(self, lanes: Lanes, plan: SlotPlan) -> list[torch.Tensor]:
        self.lanes = lanes
        return self._eager.attach(lanes, plan)

    @property
    def eager(self) -> BlockTransfer:
        return self._eager

    def start(self) -> BlockTransfer:
        """Capture every (block, slot) transfer now; where capture is unsupported, stay eager and say so."""
        p, lanes, eager = self.lanes.platform, self.lanes, self._eager
        try:
            p.synchronize()  # block 0's eager gather (issued first) is complete before capture
            graphs = []
            for i in range(len(eager.plan.shards)):
                per_slot = []
                for k in range(2):
                    copy = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(copy, stream=lanes.copy, capture_error_mode="thread_local"):
                        eager.copy_in(i, k)
                    gather = None
                    if eager.receives:
                        gather = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(gather, stream=lanes.comm, capture_error_mode="thread_local"):
                            eager.exchange(i, k, 0)
                    per_slot.append((copy, gather))
                graphs.append(per_slot)
            p.synchronize()
        except Exception as e:  # capture unsupported here: stay eager, say so
            log.warning("transfer graphs unavailable (%s: %s); using eager transfers", type(e).__name__, e)
            return eager
        self._graphs = graphs
        return self

    def issue(self, i: int, k: int, n: int) -> None:
        lanes = self.lanes
        p = lanes.platform
        copy, gather = self._graphs[i][k]
        p.set_stream(lanes.copy)
        p.wait(lanes.copy, lanes.free[k])  # [Note: stream lifetimes] rule 1
        copy.replay()
        if gather is None:
            p.record(lanes.ready[k], lanes.copy)
        else:
            p.record(lanes.h2d[k], lanes.copy)
            p.set_stream(lanes.comm)
            p.wait(lanes.comm, lanes.h2d[k])  # rule 2
            gather.replay()
            p.record(lanes.ready[k], lanes.comm)
        p.set_stream(lanes.compute)

    def release(self) -> None:
        """Drop the graphs after in-flight work: NCCL cannot tear a communicator down while graphs
        holding its collectives are alive, so this comes before leaving the group."""
        if not self._graphs:
            return
        self.lanes.platform.synchronize()
        self._graphs = []


def choose_transfer(settings: OffloadSettings, platform: Platform, group: Any, g: int) -> BlockTransfer:
    """How this model's blocks move, chosen once from the settings `load` resolved for it:
    `transfer` peer (allgather over g > 1 ranks only) pulls from the peers' slots; otherwise the
    collective (allgather) or the H2D alone (rank-local), replayed as CUDA graphs where
    `transfer_graphs` says so (None: on cuda)."""
    graphs = platform.name == "cuda" if settings.transfer_graphs is None else settings.transfer_graphs
    collective = settings.mode == "allgather"
    if settings.transfer == "peer":
        if not (collective and g > 1):
            raise ValueError("peer gathers need allgather over more than one rank")
        if graphs:
            log.info("transfer graphs off: peer gathers are issued eagerly (a host handshake per gather)")
        return PeerTransfer(group)
    eager = CollectiveTransfer(make_gather(group)) if collective else EagerTransfer()
    return GraphTransfer(eager) if graphs else eager


# [Note: where FP8 is dequantized]
# A block's FP8 weights become bfloat16 after its bytes have landed in slot k (whatever moved them:
# H2D, AllGather, peer pulls, graphs) and before the block runs: on the compute stream, right after
# it waits `ready[k]` (`SlotPrefetcher.before_block`). There it costs its own time (memory-bound:
# ~3 bytes moved per weight, 0.35 ms for a Flux.1-dev double block on the H200 in one launch of
# `dlo.engine.fp8_kernel`'s kernel, whose host cost is 0.13 ms) and needs ONE buffer for every
# block: the stream runs block i-1 before block i's dequantization overwrites it.
# On a side stream it would overlap the previous block but run beside its attention, where an SM
# kernel measured 1.5-2.6x its own time (record `interference-h200-2026-12-01`), and need a second buffer (one
# more block of device memory: what a small GPU lacks most).


class NoStep:
    """Nothing to do once a block's bytes have landed (its tensors are read from the slot)."""

    device_bytes = 0
    views: list[dict[str, torch.Tensor]] = []

    def run(self, i: int, k: int) -> None:
        pass


class Dequantize:
    """FP8 streaming's step after a block lands: each FP8 weight of block i, read from slot k with
    its scales, dequantized into the buffer its linear layer reads (`views`), on the current (compute)
    stream ([Note: where FP8 is dequantized])."""

    def __init__(self, pieces: list[tuple[DequantPiece, ...]], slots: list[torch.Tensor], device: torch.device,
                 kernel: Any = None):
        """`kernel`: the one-launch kernel's launcher (`dlo.engine.fp8_kernel`; default: Triton's on
        cuda where it is importable, none elsewhere; tests pass others)."""
        from dlo.engine.dtypes import torch_dtype

        self.device_bytes = max(dequant_bytes(p) for p in pieces)
        self.buffer = torch.empty(self.device_bytes, dtype=torch.uint8, device=device)
        # per block: the views its linear layers bind (the same buffer for every block)
        self.views = [{p.name: self.buffer[p.dst : p.dst + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)
                       for p in block} for block in pieces]
        # per block and slot: (FP8 values, scales, out) of each weight
        self._work = [[[(slot[p.src : p.src + p.shape[0] * p.shape[1]].view(torch.float8_e4m3fn).view(p.shape),
                         slot[p.scale : p.scale + 4 * p.shape[0]].view(torch.float32), self.views[b][p.name])
                        for p in block] for slot in slots] for b, block in enumerate(pieces)]

        self.block = _block_kernel(pieces, slots, self.buffer, device, kernel)
        self._checked = False  # the kernel's bytes compared once with dequantize_into's

    def run(self, i: int, k: int) -> None:
        if self.block is not None and self.block.covers(i):
            try:
                self.block.run(i, k)
            except Exception as e:  # a compiler missing on the node fails the first launch
                self._give_up(f"it failed: {type(e).__name__}: {e}")
            else:
                if self._checked or self._same_as_reference(i, k):
                    self._checked = True
                    return
                self._give_up("its bytes differ from dequantize_into's")
        for q, scale, out in self._work[i][k]:
            dequantize_into(out, q, scale)

    def _same_as_reference(self, i: int, k: int) -> bool:
        """Whether the kernel's output of block i's smallest FP8 weight equals `dequantize_into`'s
        (once, on the first block it runs: one synchronisation, in the warm-up)."""
        q, scale, out = min(self._work[i][k], key=lambda w: w[0].numel())
        return torch.equal(dequantize_into(torch.empty_like(out), q, scale), out)

    def _give_up(self, why: str) -> None:
        self.block = None
        log.warning("FP8 dequantization runs a weight at a time from here on (the one-launch kernel: %s)", why)


def _block_kernel(pieces: list[tuple[DequantPiece, ...]], slots: list[torch.Tensor], buffer: torch.Tensor,
                  device: torch.device, kernel: Any) -> Any:
    """The one-launch dequantization of each block (`dlo.engine.fp8_kernel.BlockKernel`): given a
    `kernel`, or on cuda where Triton is importable; None otherwise."""
    from dlo.engine.fp8_kernel import BlockKernel, block_kernel

    if kernel is None and (device.type != "cuda" or block_kernel() is None):
        return None
    return BlockKernel(pieces, slots, buffer, device, kernel)
