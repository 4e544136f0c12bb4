"""Blocking work of rank 0's event loop, run beside it: the rank group's start, waves and stop.

Owns: `in_daemon_thread` (a future the loop awaits, settled from a new daemon thread) and
`WaveThread` (rank 0's waves on one daemon thread for the life of the process).
Must never: run on a non-daemon thread - a rank stuck in a collective must never block process exit -
or queue a wave behind one that has not returned.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable

Outcome = tuple[Any, "BaseException | None"]


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _call(fn: Callable[[], Any]) -> Outcome:
    try:
        return fn(), None
    except BaseException as e:  # handed to the awaiting coroutine
        return None, e


def _post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, outcome: Outcome) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, *outcome)
    except RuntimeError:  # the loop closed (an abandoned wave at exit): nobody awaits it
        pass


def in_daemon_thread(fn: Callable[[], Any], name: str = "wave") -> asyncio.Future:
    """Run fn in a new daemon thread: a rank stuck in a collective must never block process exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    threading.Thread(target=lambda: _post(loop, fut, _call(fn)), name=name, daemon=True).start()
    return fut


class WaveThread:
    """Rank 0's waves, one after another, on one daemon thread that lives as long as the process.

    Why one thread: the libraries keep per-thread state. PyTorch caches cuDNN's execution plans (one
    per convolution shape) thread-locally, so a wave on a fresh thread built every plan again: the
    VAE's convolutions paid their plans at every request, and the warm-up, run at the default size
    to choose them, chose them for no one. `run(fn)` while the thread is still in an earlier job (an
    abandoned wave stuck in a collective) runs fn on a new daemon thread instead: nothing waits
    behind a stuck wave."""

    def __init__(self, name: str = "wave"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = False
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], Any]) -> asyncio.Future:
        """A future the loop awaits, settled with fn's result (or its exception)."""
        with self._lock:
            if self._busy:
                return in_daemon_thread(fn, f"{self.name}-beside")
            self._busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._jobs.put((fn, loop, fut))
        return fut

    def _serve(self) -> None:
        while True:
            fn, loop, fut = self._jobs.get()
            outcome = _call(fn)
            with self._lock:  # idle before the awaiting coroutine resumes: its next wave comes here
                self._busy = False
            _post(loop, fut, outcome)
