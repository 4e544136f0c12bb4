"""The garbage collector during a start (engine/serving/start_gc.py): off while the rank starts, then
one collection (the start's cycles freed, never frozen), a freeze and the collector back on, once."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from dlo.engine.serving.start_gc import StartGC


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def collector():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if was else gc.disable()


def test_a_start_runs_without_the_collector_and_ends_with_one_collection_and_a_freeze(collector):
    start = StartGC(True).begin()
    assert start.active and not gc.isenabled()
    cycle = _Node()
    gone = weakref.ref(cycle)
    del cycle
    assert gone() is not None  # nothing collects during the start
    before = gc.get_freeze_count()
    done = threading.Thread(target=start.end)  # the end may come from any thread (rank 0: the event loop)
    done.start()
    done.join()
    assert gone() is None, "the start's own cycles are collected before anything is frozen"
    assert gc.isenabled() and not start.active and gc.get_freeze_count() > before
    gc.disable()  # whatever turned it off after the start stays: a second end changes nothing
    start.end()
    assert not gc.isenabled()


def test_not_paused_leaves_the_collector_alone(collector):
    gc.enable()
    start = StartGC(False).begin()
    assert not start.active and gc.isenabled()
    frozen = gc.get_freeze_count()
    start.end()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_collector_already_off_is_left_off(collector):
    gc.disable()
    start = StartGC(True).begin()
    assert not start.active
    start.end()
    assert not gc.isenabled()
