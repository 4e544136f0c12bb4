"""Compatibility keys and wave forming (pure logic, no ranks)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.engine.request import Generation
from dlo.serving.waves import Pending, QueueFull, WaveQueue, compatibility_key, next_wave

BASE = Generation(kind="image", prompt="a cat", seed=1, width=64, height=64, steps=2, guidance_scale=5.0)


def test_seed_prompt_and_negative_text_do_not_change_the_key():
    other = dataclasses.replace(BASE, prompt="a dog", seed=99)
    assert compatibility_key(other) == compatibility_key(BASE)
    a = dataclasses.replace(BASE, negative_prompt="blurry")
    b = dataclasses.replace(BASE, negative_prompt="dark")
    assert compatibility_key(a) == compatibility_key(b)


def test_the_lora_adapter_and_its_scale_do_not_change_the_key():
    """Each rank adds its own adapter's branch over the same gathered weights: requests for
    different adapters, or none, run in one wave."""
    for change in ({"lora_id": "style-a"}, {"lora_id": "style-b", "lora_scale": 0.5}):
        assert compatibility_key(dataclasses.replace(BASE, **change)) == compatibility_key(BASE)


@pytest.mark.parametrize(
    "change",
    [
        {"width": 128}, {"height": 32}, {"frames": 5}, {"fps": 2}, {"steps": 3}, {"guidance_scale": 1.0},
        {"n": 2}, {"negative_prompt": ""}, {"extras": {"shift": 3}},
    ],
)
def test_every_schedule_field_changes_the_key(change):
    assert compatibility_key(dataclasses.replace(BASE, **change)) != compatibility_key(BASE)


def test_key_is_canonical_json_of_extras():
    a = dataclasses.replace(BASE, extras={"a": 1, "b": [1, 2]})
    b = dataclasses.replace(BASE, extras={"b": [1, 2], "a": 1})
    assert compatibility_key(a) == compatibility_key(b)


def _pending(i: int, key_choice: int, t: float) -> Pending:
    return Pending(dataclasses.replace(BASE, seed=i, steps=1 + key_choice), enqueued=t)


def test_full_wave_starts_without_waiting():
    q = [_pending(i, 0, 10.0) for i in range(3)]
    wave, wait = next_wave(q, dp=2, now=10.0, window_s=5.0)
    assert [p.gen.seed for p in wave] == [0, 1] and wait is None


def test_partial_wave_waits_for_the_window_then_starts():
    q = [_pending(0, 0, 10.0)]
    wave, wait = next_wave(q, dp=2, now=10.001, window_s=0.005)
    assert wave == [] and wait == pytest.approx(0.004)
    wave, wait = next_wave(q, dp=2, now=10.006, window_s=0.005)
    assert len(wave) == 1


def test_incompatible_neighbour_waits_for_a_later_wave_instead_of_being_rejected():
    q = [_pending(0, 0, 1.0), _pending(1, 1, 1.0), _pending(2, 0, 1.0)]
    wave, _ = next_wave(q, dp=3, now=100.0, window_s=0.005)
    assert [p.gen.seed for p in wave] == [0, 2]


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.integers(0, 3), min_size=0, max_size=30), dp=st.integers(1, 8))
def test_draining_the_queue_serves_every_request_once_in_compatible_waves(keys, dp):
    queue = [_pending(i, k, float(i)) for i, k in enumerate(keys)]
    served: list[int] = []
    now = 1e9  # every window has expired
    while queue:
        wave, wait = next_wave(queue, dp, now, 0.005)
        assert wave and wait is None
        assert 1 <= len(wave) <= dp
        assert len({p.key for p in wave}) == 1
        assert wave[0] is queue[0]  # the oldest request always leads the next wave
        ids = {id(p) for p in wave}
        queue = [p for p in queue if id(p) not in ids]
        served += [p.gen.seed for p in wave]
    assert sorted(served) == list(range(len(keys)))


async def test_wave_queue_rejects_beyond_max_queue_and_returns_waves():
    q = WaveQueue(dp=2, window_s=0.01, max_queue=2)
    q.put(_pending(0, 0, 0.0))
    q.put(_pending(1, 1, 0.0))
    with pytest.raises(QueueFull):
        q.put(_pending(2, 0, 0.0))
    first = await asyncio.wait_for(q.take_wave(), 2)
    second = await asyncio.wait_for(q.take_wave(), 2)
    assert [len(first), len(second)] == [1, 1] and first[0].key != second[0].key
    assert len(q) == 0
