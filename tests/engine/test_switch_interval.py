"""The start's thread switch interval (engine/serving/switch_interval.py): set for the start, the
interpreter's own back once it ends, once, from any thread."""

from __future__ import annotations

import sys
import threading

import pytest

from dlo.engine.serving.switch_interval import StartSwitchInterval


@pytest.fixture
def interpreter_interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_a_start_runs_at_its_interval_and_ends_at_the_previous_one(interpreter_interval):
    start = StartSwitchInterval(0.0005).begin()
    assert start.active and sys.getswitchinterval() == pytest.approx(0.0005)
    start.begin()  # a second begin keeps the interpreter's interval to go back to
    done = threading.Thread(target=start.end)
    done.start()
    done.join()
    assert not start.active and sys.getswitchinterval() == pytest.approx(interpreter_interval)
    sys.setswitchinterval(0.002)  # whatever set it after the start stays: a second end changes nothing
    start.end()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_none_leaves_the_interpreter_alone(interpreter_interval):
    start = StartSwitchInterval(None).begin()
    assert not start.active and sys.getswitchinterval() == pytest.approx(interpreter_interval)
    start.end()
    assert sys.getswitchinterval() == pytest.approx(interpreter_interval)


@pytest.mark.parametrize("seconds", [0.0, -0.001])
def test_an_interval_of_zero_or_less_is_refused(seconds):
    with pytest.raises(ValueError, match="must be > 0"):
        StartSwitchInterval(seconds)
