"""Rank 0's waves on one thread (`dlo.serving.threads.WaveThread`): the libraries' per-thread
state (cuDNN's execution plans per convolution shape) outlives a wave, and a stuck wave holds no
later one back."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dlo.serving.threads import WaveThread


def test_waves_run_one_after_another_on_one_thread():
    async def main() -> list[int]:
        waves = WaveThread()
        first = await waves.run(threading.get_ident)
        with pytest.raises(ValueError, match="bad wave"):
            await waves.run(lambda: (_ for _ in ()).throw(ValueError("bad wave")))
        second = await waves.run(threading.get_ident)
        return [first, second, threading.get_ident()]

    first, second, loop_thread = asyncio.run(main())
    assert first == second != loop_thread  # the same thread for every wave, the loop's own never


def test_a_wave_sent_while_one_is_stuck_runs_beside_it():
    release = threading.Event()

    async def main() -> tuple[int, int, str]:
        waves = WaveThread()
        stuck = waves.run(lambda: release.wait(30) and threading.get_ident())
        beside = await asyncio.wait_for(waves.run(threading.get_ident), 10)  # not queued behind it
        assert not stuck.done()
        release.set()
        held = await asyncio.wait_for(stuck, 10)
        after = await asyncio.wait_for(waves.run(lambda: threading.current_thread().name), 10)
        return held, beside, after

    held, beside, after = asyncio.run(main())
    assert held != beside and after == "wave"  # the wave thread again once it is free
