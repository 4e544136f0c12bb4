"""Gather-wait timing on stream platforms: event pairs around the compute stream's waits are read
back without ever synchronising, in order, and a full ring skips timing instead of blocking.

Streams exist only on accelerators, so an accelerator clock stands in for the device here: every
wait the compute stream does advances it by WAIT seconds, and events complete once the clock's
"device" has reached them. The prefetcher code under test is the real one.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dlo.engine.prefetch import WAIT_RING, SlotPrefetcher
from dlo.engine.transfers import EagerTransfer
from dlo.engine.platform import Platform
from dlo.engine.families.tiny import make_tiny_transformer

WAIT = 0.001


class ClockPlatform(Platform):
    has_streams = True

    def __init__(self) -> None:
        self.now = 0.0
        self.done_upto = math.inf

    def new_stream(self, role: str):
        return SimpleNamespace(role=role)

    def current_stream(self):
        return SimpleNamespace(role="compute")

    def new_event(self, timing: bool = False):
        return SimpleNamespace(t=None)

    def record(self, event, stream) -> None:
        event.t = self.now

    def wait(self, stream, event) -> None:
        if stream.role == "compute":  # only the compute stream's stalls are gather wait
            self.now += WAIT

    def elapsed_seconds(self, start, end):
        if end.t is None or end.t > self.done_upto:
            return None
        return end.t - start.t


@pytest.fixture
def pipeline(tmp_path):
    from dlo.engine import OffloadSettings, load

    m = load(make_tiny_transformer(tmp_path / "t", "wan", layers=3), settings=OffloadSettings("rank-local"), device="cpu")
    src = m.prefetcher
    clock = ClockPlatform()
    pipe = SlotPrefetcher(m.module, src.blocks, src.copies, transfer=EagerTransfer(),
                          settings=OffloadSettings("rank-local", time_waits=True),
                          platform=clock, device=src.slots[0].device, g=1, r=0)
    return pipe, clock


def run_blocks(pipe: SlotPrefetcher, n: int) -> None:
    for step in range(n):
        pipe.before_block(step % len(pipe.blocks))
        pipe.after_block()


def test_completed_waits_are_summed(pipeline):
    pipe, clock = pipeline
    run_blocks(pipe, 12)
    assert pipe.stats.gather_wait_seconds == 0  # nothing read back until asked
    pipe.collect_waits()
    assert pipe.stats.gather_wait_seconds == pytest.approx(12 * WAIT)
    assert pipe.stats.gathers == 13  # 12 blocks each prefetch the next, plus block 0 at load


def test_full_ring_skips_timing_and_never_blocks(pipeline):
    pipe, clock = pipeline
    clock.done_upto = -1.0  # the device has completed nothing
    run_blocks(pipe, WAIT_RING + 40)
    assert len(pipe._wait_pending) == WAIT_RING  # 40 waits went untimed rather than waiting
    pipe.collect_waits()
    assert pipe.stats.gather_wait_seconds == 0
    clock.done_upto = math.inf
    pipe.collect_waits()
    assert pipe.stats.gather_wait_seconds == pytest.approx(WAIT_RING * WAIT)
    assert pipe._wait_pending == []


def test_collection_stops_at_first_event_in_flight(pipeline):
    pipe, clock = pipeline
    run_blocks(pipe, 5)
    clock.done_upto = 2.5 * WAIT  # the first two waits' end events are complete
    pipe.collect_waits()
    assert pipe.stats.gather_wait_seconds == pytest.approx(2 * WAIT)
    assert len(pipe._wait_pending) == 3
