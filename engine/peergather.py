"""Peer gathers: each rank copies the other ranks' shards of a block straight out of their slots.

Owns: `PeerGather` (the slots every rank of the shard group can read, the per-gather handshake, the
pulls) and the check that every rank of a shard group gathers the same way (`agree_on_path`, over
`OffloadSettings.transfer`: `--gather peer`, `DLO_GATHER=peer`).
Must never: run a kernel (the point is that no SM works on a gather), let a rank overwrite its part
of a slot while a peer may still be reading it, or wait on a peer's event before the peer has
enqueued the record it is meant to see ([Note: peer handshake]).

Why: the in-place AllGather of `dlo.engine.prefetch` is an NCCL kernel. While its CTAs hold SMs,
attention and GEMMs launched beside it wait for them: on one H200 a 1.7 ms copy kernel of 8 CTAs
cost attention 4.5 ms and GEMMs 3.2 ms, while a 7 ms copy-engine H2D cost either at most 0.15 ms
(bench/results/interference-h200-2026-12-01). That is the ~1-2% allgather adds over resident (and
over rank-local) on compute-bound video (the same record). A pull is a memcpy between two
devices of one node: the copy engines carry it over NVLink and no SM works on it. On CPU ranks the
slots are shared-memory files and a pull is a memcpy out of the peer's file (what CI runs).

Requirements, checked at load (a step that fails on one rank fails every rank with the same
message, `PeerGather._step`, so none is left waiting in a collective): every rank of the shard group
on one host (host name and boot id), every device visible to every rank in the same order (CUDA IPC
opens a peer's memory under the peer's device index; checked by device UUID; a context on each peer
device costs each rank a few hundred MB there), and one shared-memory directory (`/dev/shm`, else
the temp directory; rank 0's choice) for the counters and CPU slots: files another rank made are
opened, never created, and the counters carry rank 0's magic number.

Failure: a peer that has not reached a gather within the shard group's collective timeout
(`PEER_WAIT_S` where it cannot be read) raises `PeerGatherError` and the prefetcher is broken, as
for a failed collective. At close a CUDA rank waits (at most `CLOSE_WAIT_S`) for every peer to say it
is done: its slots die with its process, and a peer's last pull may still be reading them.

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
from typing import Any

import torch
import torch.distributed as dist

from dlo.engine.settings import Transfer

log = logging.getLogger(__name__)

GATHER_ENV = "DLO_GATHER"  # named in messages (the variable beside `--gather`)
# A peer that has not reached a gather by then is taken for dead: the prefetcher breaks loudly
# (the engine restarts) instead of hanging. Used where the shard group's own collective timeout
# cannot be read; far above any block's transfer.
PEER_WAIT_S = 600.0
# At close a CUDA rank waits this long for its peers to finish reading its slots before freeing them.
CLOSE_WAIT_S = 10.0
_LANDED, _PULLED = 0, 1


class PeerGatherError(RuntimeError):
    """The peer path cannot run here, or a peer stopped answering."""


def agree_on_path(group: Any, device: torch.device, transfer: Transfer) -> Transfer:
    """`transfer` (`OffloadSettings.transfer`: `collective`, the platform's in-place AllGather, or
    `peer`, each rank copying the peers' shards out of their slots: the copy engines on CUDA, no SM)
    of every rank of the shard group, the same or none starts: one object all-gather at load (a rank
    that pulls while another waits in a collective would hang both)."""
    values = _all_gather_object(transfer, group, device)
    if len(set(values)) > 1:
        raise PeerGatherError(f"the ranks of the shard group disagree on the transfer (--gather, {GATHER_ENV}): "
                              f"{values} (rank order); set the same value on every rank")
    return transfer


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


def _host_identity() -> str:
    """This host (and boot): ranks that share files and device memory must all print the same."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{os.uname().nodename}/{boot}"


def _group_timeout_s(group: Any, device: torch.device) -> float:
    """The shard group's collective timeout (a peer later than that would have failed a collective
    too), else PEER_WAIT_S."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # a backend without readable options
        return PEER_WAIT_S


def _map_existing(path: Path, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A shared mapping of a file another rank made, refusing to create it (`torch.from_file` would:
    a rank on another filesystem would then read zeros instead of failing)."""
    want = n * torch.empty((), dtype=dtype).element_size()
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PeerGatherError(f"{path} is missing here: the ranks do not share {path.parent}") from None
    if size != want:
        raise PeerGatherError(f"{path} holds {size} bytes, not {want}: the ranks do not share {path.parent}")
    return torch.from_file(str(path), shared=True, size=n, dtype=dtype)


class PeerGather:
    """The slots of one rank of a shard group, readable by every other rank, and the pulls out of theirs.

    Setup is a sequence of steps that every rank runs and then reports on in one object all-gather
    (`_step`): a step that fails on one rank (a device it cannot see, IPC refused, no memory, files
    not shared) raises the same `PeerGatherError` on every rank, so none is left waiting in the next
    collective."""

    def __init__(self, *, group: Any, g: int, r: int, device: torch.device, slot_bytes: int,
                 copy_stream: Any, comm_stream: Any):
        if device.type not in ("cuda", "cpu"):
            raise PeerGatherError(f"{GATHER_ENV}=peer runs on cuda or cpu ranks, not {device.type}")
        self.group, self.g, self.r, self.device = group, g, r, device
        self.cuda = device.type == "cuda"
        self.copy_stream, self.comm_stream = copy_stream, comm_stream
        self.peers = [p for p in range(g) if p != r]
        self.wait_s = _group_timeout_s(group, device)
        self.peer_slots: dict[int, list[torch.Tensor]] = {}
        self.peer_landed: dict[int, list[Any]] = {}
        self.peer_pulled: dict[int, list[Any]] = {}
        self._counters: torch.Tensor | None = None
        # rank 0 names the files (directory and token) and writes the counters with a magic number
        # that the others check: ranks that do not share the files find out here, not 600 s later
        token = uuid.uuid4().hex
        named = self._step(lambda: (_host_identity(), f"{_shared_dir()}/dlo-peer-{token}", int(token[:15], 16)),
                           "naming its host")
        hosts = [host for host, _, _ in named]
        if len(set(hosts)) > 1:
            raise PeerGatherError(f"{GATHER_ENV}=peer needs every rank of the shard group on one host; "
                                  f"they run on {hosts}")
        _, base, self._magic = named[0]
        self._n_counters = 1 + 2 * g * 2 + g  # magic, landed/pulled per rank and slot, closed per rank
        counters = Path(f"{base}-counters")
        own = [Path(f"{base}-r{r}-s{k}") for k in range(2)]
        try:
            self._step(lambda: self._make_own(own, counters, slot_bytes), "making its slots")
            self._step(lambda: self._open_counters(counters), "opening the shared counters")
            mine = self._step(self._describe_own, "describing its slots")
            self._step(lambda: self._open_peers(mine, base, slot_bytes), "opening the peers' slots and events")
        finally:
            for f in (*own, *((counters,) if r == 0 else ())):
                f.unlink(missing_ok=True)  # every rank has mapped what it needs (or none will)
        self._peer_streams = (
            {p: torch.cuda.Stream(device=self.peer_slots[p][0].device) for p in self.peers
             if self.peer_slots[p][0].device != device} if self.cuda else {})
        log.info("peer gathers: %d ranks pull each other's shards %s (%s=peer)", g,
                 "with the copy engines" if self.cuda else "out of shared memory", GATHER_ENV)

    # ---- setup -------------------------------------------------------------------------------------
    def _step(self, fn: Any, what: str) -> list[Any]:
        """Run fn here, then learn every rank's outcome: the payloads in rank order, or the same
        PeerGatherError on every rank when any failed."""
        try:
            mine: tuple[str, Any] = ("ok", fn())
        except Exception as e:
            mine = ("error", f"{type(e).__name__}: {e}")
        everyone = _all_gather_object(mine, self.group, self.device)
        failed = [(rank, msg) for rank, (state, msg) in enumerate(everyone) if state == "error"]
        if failed:
            detail = "; ".join(f"rank {rank} {what}: {msg}" for rank, msg in failed)
            raise PeerGatherError(f"{GATHER_ENV}=peer cannot start: {detail}; unset {GATHER_ENV} to gather "
                                  "with the collective")
        return [payload for _, payload in everyone]

    def _make_own(self, own: list[Path], counters: Path, slot_bytes: int) -> None:
        if self.r == 0:
            init = torch.full((self._n_counters,), -1, dtype=torch.int64)
            init[0] = self._magic
            init[-self.g:] = 0  # nobody closed
            init.numpy().tofile(counters)
        if self.cuda:
            self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
            return
        for f in own:  # shared files the peers map; the space is reserved now (tmpfs: no SIGBUS later)
            fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, slot_bytes)
            finally:
                os.close(fd)
        self.slots = [torch.from_file(str(f), shared=True, size=slot_bytes, dtype=torch.uint8) for f in own]

    def _open_counters(self, counters: Path) -> None:
        self._counters = _map_existing(counters, self._n_counters, torch.int64)
        if int(self._counters[0]) != self._magic:
            raise PeerGatherError(f"{counters} is not rank 0's counters: the ranks do not share {counters.parent}")

    def _describe_own(self) -> Any:
        """What a peer needs to read this rank: CUDA, the device's UUID and index, IPC handles of the
        slots and of the two events per slot; CPU, nothing (the files are named by rank)."""
        if not self.cuda:
            self.landed = self.pulled = [None, None]
            return None
        from torch.multiprocessing.reductions import reduce_tensor

        with torch.cuda.device(self.device):
            self.landed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            self.pulled = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for e in (*self.landed, *self.pulled):
                e.record()  # once, so that a first wait on it passes
            torch.cuda.synchronize(self.device)
        return (str(torch.cuda.get_device_properties(self.device).uuid), self.device.index,
                pickle.dumps([reduce_tensor(s) for s in self.slots]),
                [e.ipc_handle() for e in self.landed], [e.ipc_handle() for e in self.pulled])

    def _open_peers(self, described: list[Any], base: str, slot_bytes: int) -> None:
        if not self.cuda:
            self.peer_slots = {p: [_map_existing(Path(f"{base}-r{p}-s{k}"), slot_bytes, torch.uint8)
                                   for k in range(2)] for p in self.peers}
            return
        here = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        for p in self.peers:
            uuid_p, index_p, slots, landed, pulled = described[p]
            if here.get(uuid_p) != index_p:  # CUDA IPC opens a peer's memory under the peer's index
                raise PeerGatherError(
                    f"rank {p}'s device {uuid_p} is cuda:{index_p} there but "
                    f"{'not visible' if uuid_p not in here else f'cuda:{here[uuid_p]}'} here: every rank "
                    "must see every device of the node in the same order (CUDA_VISIBLE_DEVICES)")
            self.peer_slots[p] = [fn(*args) for fn, args in pickle.loads(slots)]
            self.peer_landed[p] = [torch.cuda.Event.from_ipc_handle(index_p, h) for h in landed]
            self.peer_pulled[p] = [torch.cuda.Event.from_ipc_handle(index_p, h) for h in pulled]

    # ---- the handshake ([Note: peer handshake]) ----------------------------------------------------
    def _counter(self, kind: int, rank: int, k: int) -> int:
        return 1 + (kind * self.g + rank) * 2 + k  # after the magic number

    def _closed(self, rank: int) -> int:
        return self._n_counters - self.g + rank

    def _wait_until(self, idx: dict[int, int], at_least: int, wait_s: float) -> list[int]:
        """Poll until every peer's counter `idx[p]` is >= at_least; the peers still behind after
        `wait_s` seconds (empty: none)."""
        deadline = None
        spins = 0
        while True:
            behind = [p for p, i in idx.items() if int(self._counters[i]) < at_least]
            if not behind:
                return []
            spins += 1
            if spins > 100:  # a peer a block behind is normal: sleep rather than spin
                time.sleep(0.0002)
                now = time.monotonic()
                deadline = deadline or now + wait_s
                if now > deadline:
                    return behind

    def _wait_for_peers(self, kind: int, k: int, at_least: int, what: str) -> None:
        behind = self._wait_until({p: self._counter(kind, p, k) for p in self.peers}, at_least, self.wait_s)
        if behind:
            raise PeerGatherError(f"peer gather {at_least}: rank(s) {behind} did not {what} in "
                                  f"{self.wait_s:.0f} s; restart the engine")

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
        """Say this rank is done, drop the peers' mappings (this rank's slots are freed with the
        prefetcher). The caller has synchronised the device, so this rank reads nothing any more. On
        CUDA a rank's slots die with its process, so it first waits (at most CLOSE_WAIT_S) until every
        peer has said the same: a peer's last pull (the next call's first block) may still be
        reading them. A CPU rank's files outlive it in the peers' mappings: no wait."""
        if self._counters is None:
            return
        self._counters[self._closed(self.r)] = 1
        if self.cuda:
            behind = self._wait_until({p: self._closed(p) for p in self.peers}, 1, CLOSE_WAIT_S)
            if behind:
                log.warning("peer gathers: rank(s) %s had not closed after %.0f s; closing anyway (a pull "
                            "of theirs may still read this rank's slots)", behind, CLOSE_WAIT_S)
        self.peer_slots = {}
        self.peer_landed, self.peer_pulled = {}, {}
        self._counters = None
