"""Peer gathers: each rank copies the other ranks' shards of a block straight out of their slots.

Owns: `DLO_GATHER` (`gather_path`: `collective`, the default, or `peer`), `PeerGather` (the slots
every rank of the shard group can read, the per-gather handshake, the pulls) and the check that
every rank of a shard group gathers the same way (`agree_on_path`).
Must never: run a kernel (the point is that no SM works on a gather), let a rank overwrite its part
of a slot while a peer may still be reading it, or wait on a peer's event before the peer has
enqueued the record it is meant to see ([Note: peer handshake]).

Why: the in-place AllGather of `dlo.engine.prefetch` is an NCCL kernel. While its CTAs hold SMs,
attention and GEMMs launched beside it wait for them: on one H200 a 1.7 ms copy kernel of 8 CTAs
cost attention 4.5 ms and GEMMs 3.2 ms, while a 7 ms copy-engine H2D cost either at most 0.15 ms
(bench/results/interference-h200-2026-12-01). That is the ~1-2% allgather adds over resident (and
over rank-local) on compute-bound video (bench/NOTES.md section 15). A pull is a memcpy between two
devices of one node: the copy engines carry it over NVLink and no SM works on it. On CPU ranks the
slots are shared-memory files and a pull is a memcpy out of the peer's file (what CI runs).

Requirements (checked at load, with a message naming what is missing): every rank of the shard
group on this host, sees every device (CUDA IPC opens a peer's memory under the peer's device
index; a context on each peer device costs each rank a few hundred MB there), and a writable
shared-memory directory (`/dev/shm`, else the temp directory) for the counters (and CPU slots).

[Note: peer handshake]
Gather n (the n-th since load) uses slot k = n % 2 on every rank. Two host counters per rank and
slot, in shared memory: `landed[r][k]` (r has enqueued its H2D of gather n into slot k) and
`pulled[r][k]` (r has enqueued its pulls of gather n out of the peers' slot k). Rank r:

  a(n) before its H2D: wait until every peer's `pulled[p][k] >= n - 2`; its copy stream waits the
       peers' `pulled` events (their last record is that pull), so no peer still reads r's part of
       slot k; H2D; record its `landed` event; publish `landed[r][k] = n`.
  b(n) before its pulls: wait until every peer's `landed[p][k] >= n`; its comm stream waits the
       peers' `landed` events, pulls each peer's part into its own slot k, records its `pulled`
       event and `ready[k]`; publish `pulled[r][k] = n`.

A CUDA stream waits on the last record of an event enqueued *before* the wait. The counters make
that the record meant: an event's next record (for n + 2) comes only after every waiter enqueued
its wait on this one (a(n + 2) needs `pulled >= n`, published after b(n)'s waits; b(n + 2) needs
`landed >= n + 2`, published after a(n + 2)'s waits). No cycle: a(n) needs the peers' b(n - 2),
b(n) their a(n). On CPU every copy is synchronous and the counters alone order the bytes.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

GATHER_ENV = "DLO_GATHER"
GATHER_PATHS = ("collective", "peer")  # the default first
# A peer that has not reached a gather by then is taken for dead: the prefetcher breaks loudly
# (the engine restarts) instead of hanging. Far above any block's transfer.
PEER_WAIT_S = 600.0
_LANDED, _PULLED = 0, 1


class PeerGatherError(RuntimeError):
    """The peer path cannot run here, or a peer stopped answering."""


def gather_path(environ: Mapping[str, str] = os.environ) -> str:
    """How allgather mode rebuilds a block, from `DLO_GATHER`: `collective` (the default: the
    platform's in-place AllGather) or `peer` (each rank copies the peers' shards out of their slots:
    the copy engines on CUDA, no SM). Empty (a template's default) is unset; anything else is refused."""
    value = environ.get(GATHER_ENV, "").strip() or GATHER_PATHS[0]
    if value not in GATHER_PATHS:
        raise ValueError(f"{GATHER_ENV} must be one of {', '.join(GATHER_PATHS)}, got {value!r}")
    return value


def agree_on_path(path: str, group: Any, device: torch.device) -> None:
    """Every rank of the shard group gathers the same way, or none starts: one object all-gather at
    load (a rank that pulls while another waits in a collective would hang both)."""
    paths = _all_gather_object(path, group, device)
    if len(set(paths)) > 1:
        raise PeerGatherError(f"the ranks of the shard group disagree on {GATHER_ENV}: {paths} (rank order); "
                              "set the same value on every rank")


def _all_gather_object(obj: Any, group: Any, device: torch.device) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    if device.type == "cuda":
        with torch.cuda.device(device):  # the object collective stages through the current device
            dist.all_gather_object(out, obj, group=group)
    else:
        dist.all_gather_object(out, obj, group=group)
    return out


def _shared_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class PeerGather:
    """The slots of one rank of a shard group, readable by every other rank, and the pulls out of theirs."""

    def __init__(self, *, group: Any, g: int, r: int, device: torch.device, slot_bytes: int,
                 copy_stream: Any, comm_stream: Any):
        if device.type not in ("cuda", "cpu"):
            raise PeerGatherError(f"{GATHER_ENV}=peer runs on cuda or cpu ranks, not {device.type}")
        self.g, self.r, self.device = g, r, device
        self.cuda = device.type == "cuda"
        self.copy_stream, self.comm_stream = copy_stream, comm_stream
        self.peers = [p for p in range(g) if p != r]
        # 1. a name every rank agrees on (rank 0's), for the shared files
        token = _all_gather_object(uuid.uuid4().hex if r == 0 else None, group, device)[0]
        base = _shared_dir() / f"dlo-peer-{token}"
        counters = Path(f"{base}-counters")
        if r == 0:
            torch.full((2 * g * 2,), -1, dtype=torch.int64).numpy().tofile(counters)
        slot_files = [Path(f"{base}-r{r}-s{k}") for k in range(2)]
        try:
            if self.cuda:
                self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            else:  # shared files, so that the peers can map them
                self.slots = [torch.from_file(str(f), shared=True, size=slot_bytes, dtype=torch.uint8)
                              for f in slot_files]
            self._barrier(group)  # the counters exist; every rank's slots exist
            self._counters = torch.from_file(str(counters), shared=True, size=2 * g * 2, dtype=torch.int64)
            self.peer_slots = self._open_peer_slots(group, base, slot_bytes)
            self._events()
            self._exchange_events(group)
            self._barrier(group)  # every rank has mapped what it needs: the names can go
        finally:
            for f in (*slot_files, *((counters,) if r == 0 else ())):
                f.unlink(missing_ok=True)
        self._peer_streams = (
            {p: torch.cuda.Stream(device=self.peer_slots[p][0].device) for p in self.peers
             if self.peer_slots[p][0].device != device} if self.cuda else {})
        log.info("peer gathers: %d ranks pull each other's shards %s (%s=peer)", g,
                 "with the copy engines" if self.cuda else "out of shared memory", GATHER_ENV)

    # ---- setup -------------------------------------------------------------------------------------
    def _barrier(self, group: Any) -> None:
        _all_gather_object(None, group, self.device)

    def _open_peer_slots(self, group: Any, base: str, slot_bytes: int) -> dict[int, list[torch.Tensor]]:
        if not self.cuda:
            return {p: [torch.from_file(f"{base}-r{p}-s{k}", shared=True, size=slot_bytes, dtype=torch.uint8)
                        for k in range(2)] for p in self.peers}
        from torch.multiprocessing.reductions import reduce_tensor

        mine = [reduce_tensor(s) for s in self.slots]  # CUDA IPC handles of this rank's slots
        everyone = _all_gather_object(pickle.dumps(mine), group, self.device)
        out: dict[int, list[torch.Tensor]] = {}
        for p in self.peers:
            try:
                out[p] = [fn(*args) for fn, args in pickle.loads(everyone[p])]
            except Exception as e:  # a device this rank cannot see, IPC refused (containers, MIG)
                raise PeerGatherError(
                    f"{GATHER_ENV}=peer: rank {self.r} cannot open rank {p}'s slots ({type(e).__name__}: {e}); "
                    f"every rank must see every device of the node (CUDA_VISIBLE_DEVICES) and CUDA IPC "
                    f"must be allowed; unset {GATHER_ENV} to gather with the collective") from e
        return out

    def _events(self) -> None:
        """This rank's interprocess events: `landed[k]` (its H2D of slot k) and `pulled[k]` (its
        pulls into slot k), each recorded once so that a first wait on it passes."""
        if not self.cuda:
            self.landed = self.pulled = [None, None]
            return
        with torch.cuda.device(self.device):
            self.landed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            self.pulled = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for e in (*self.landed, *self.pulled):
                e.record()
            torch.cuda.synchronize(self.device)

    def _exchange_events(self, group: Any) -> None:
        self.peer_landed: dict[int, list[Any]] = {}
        self.peer_pulled: dict[int, list[Any]] = {}
        if not self.cuda:
            return
        mine = (self.device.index, [e.ipc_handle() for e in self.landed], [e.ipc_handle() for e in self.pulled])
        everyone = _all_gather_object(mine, group, self.device)
        for p in self.peers:
            dev, landed, pulled = everyone[p]
            self.peer_landed[p] = [torch.cuda.Event.from_ipc_handle(dev, h) for h in landed]
            self.peer_pulled[p] = [torch.cuda.Event.from_ipc_handle(dev, h) for h in pulled]

    # ---- the handshake ([Note: peer handshake]) ----------------------------------------------------
    def _counter(self, kind: int, rank: int, k: int) -> int:
        return (kind * self.g + rank) * 2 + k

    def _wait_for_peers(self, kind: int, k: int, at_least: int, what: str) -> None:
        idx = [self._counter(kind, p, k) for p in self.peers]
        deadline = None
        spins = 0
        while True:
            behind = [p for p, i in zip(self.peers, idx) if int(self._counters[i]) < at_least]
            if not behind:
                return
            spins += 1
            if spins > 100:  # a peer a block behind is normal: sleep rather than spin
                time.sleep(0.0002)
                now = time.monotonic()
                deadline = deadline or now + PEER_WAIT_S
                if now > deadline:
                    raise PeerGatherError(f"peer gather {at_least}: rank(s) {behind} did not {what} in "
                                          f"{PEER_WAIT_S:.0f} s; restart the engine")

    def _publish(self, kind: int, k: int, n: int) -> None:
        self._counters[self._counter(kind, self.r, k)] = n

    def before_h2d(self, n: int, k: int) -> None:
        """a(n), first half: the peers are done reading this rank's part of slot k (on the copy stream)."""
        self._wait_for_peers(_PULLED, k, n - 2, f"pull gather {n - 2}")
        if self.cuda:
            for p in self.peers:
                self.copy_stream.wait_event(self.peer_pulled[p][k])

    def after_h2d(self, n: int, k: int) -> None:
        """a(n), second half: this rank's part of gather n is on its way (enqueued on the copy stream)."""
        if self.cuda:
            self.landed[k].record(self.copy_stream)
        self._publish(_LANDED, k, n)

    def pull(self, n: int, k: int, shard: int) -> None:
        """b(n): copy every peer's part of gather n (`shard` bytes at `p * shard`) into slot k, on
        the comm stream (the current stream of this rank's device when called)."""
        self._wait_for_peers(_LANDED, k, n, f"copy in gather {n}")
        dst = self.slots[k]
        if self.cuda:
            for p in self.peers:
                self.comm_stream.wait_event(self.peer_landed[p][k])
        for p in self.peers:
            src = self.peer_slots[p][k].narrow(0, p * shard, shard)
            part = dst.narrow(0, p * shard, shard)
            stream = self._peer_streams.get(p)
            if stream is None:  # same device (or CPU): a plain copy on the current (comm) stream
                part.copy_(src, non_blocking=True)
            else:
                # across devices torch copies on the source device's current stream, ordered after
                # and before the destination's current stream (the comm stream) by events
                with torch.cuda.stream(stream):
                    part.copy_(src, non_blocking=True)
        if self.cuda:
            self.pulled[k].record(self.comm_stream)
        self._publish(_PULLED, k, n)

    def close(self) -> None:
        """Drop the peers' mappings (this rank's slots are freed with the prefetcher)."""
        self.peer_slots = {}
        self.peer_landed, self.peer_pulled = {}, {}
