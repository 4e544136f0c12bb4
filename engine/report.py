"""What a loaded model reports: `LoadReport` (how it was loaded) and `GatherStats` (what it moved).

Owns: the two plain data types `dlo.engine.load` hands out, so that torch-free code (the serving
control messages between ranks, metrics, benchmarks) can carry and read them without importing torch;
`GatherStats` is the one definition of the gather counters (serving's `RankStats` extends it, sums
of several models are `GatherStats.total`).
Must never: import torch, or hold anything but plain numbers and strings (they are pickled between
processes and printed as JSON).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable

from dlo.plan.facts import Mode


@dataclass(frozen=True)
class LoadReport:
    """How `dlo.engine.load` placed the weights (docs/contracts.md section 3)."""

    mode: Mode
    weights_source: str  # "registered" | "arena" | "resident"
    blocks: int  # offloaded blocks
    largest_block_bytes: int
    host_pinned_bytes: int
    slot_bytes: int  # both slots together
    resident_bytes: int  # non-block + resident-block weights on the device
    load_seconds: float
    shard_group_size: int = 1
    rank: int = 0
    resident_blocks: int = 0
    pinned: bool = False  # the host weights are really page-locked (DMA-able)
    transfer: str = "none"  # "graph" | "eager" | "peer" (DLO_GATHER=peer) | "none" (resident)
    model_bytes: int = 0
    # non-block weights left in the host page cache (the family's `unused` and `host_lookups`)
    host_only_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GatherStats:
    """The slot prefetcher's cumulative counters at one moment (`OffloadedModel.stats()`)."""

    gathers: int = 0
    h2d_bytes: int = 0
    collective_bytes: int = 0  # bytes received from other ranks
    # Time the compute stream stalled waiting for weights. CPU: host time in the (synchronous)
    # gathers. Streams: event pairs around each wait, read back once complete (never a host sync).
    gather_wait_seconds: float = 0.0
    # step caches (`dlo.engine.step_cache`): block calls a request's cache skipped on this rank (its
    # blocks called, their forward not run), and the bytes this rank did not move for the streamed
    # ones no rank of its shard group ran (its H2D shard and what the gather would have received)
    block_calls_skipped: int = 0
    bytes_not_streamed: int = 0

    @classmethod
    def total(cls, stats: Iterable["GatherStats"]) -> "GatherStats":
        """The counters of several models (a pipeline's streamed transformers and encoders) summed."""
        sums = {f.name: f.default for f in fields(GatherStats)}
        for s in stats:
            for name in sums:
                sums[name] += getattr(s, name)
        return cls(**sums)
