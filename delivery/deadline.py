"""Bounded waits on a store: a fetch ends by its deadline, and a transfer that moves fewer bytes than
a minimum rate over a window is a stall, whatever the store keeps trickling.

Owns: `Guard` (one fetch's overall deadline, `--deadline`, and its stall bound, `--min-rate` over
`--stall-window`: `run` runs the whole fetch on a thread of its own and answers FetchError `timeout`
at the deadline, however the fetch is blocked; `parallel` runs a transfer's tasks on `concurrency`
threads and stops them at the first error, the deadline or a stall; `stopped` tells a task to
return between reads; `commit` lets the fetch publish only while the deadline has not passed).
Must never: wait on a store without a bound, publish after the fetch was answered `timeout`, or
let a thread blocked in a read keep the process from exiting (every thread here is a daemon).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dlo.delivery.errors import FetchError

T = TypeVar("T")

DEFAULT_DEADLINE_S = 6 * 3600.0
DEFAULT_MIN_RATE_BPS = 16 * 1024
DEFAULT_STALL_WINDOW_S = 300.0
POLL_S = 0.25


class Guard:
    """`Guard(deadline_s, min_rate_bps, window_s, moved)`: `moved()` is the bytes this fetch moved so
    far (the progress counter), read while a transfer runs."""

    def __init__(self, deadline_s: float, min_rate_bps: int, window_s: float, moved: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline_s, self.min_rate_bps, self.window_s = deadline_s, min_rate_bps, window_s
        self.moved, self.clock = moved, clock
        self.ends = clock() + deadline_s
        self.expired = threading.Event()  # set once the fetch was answered `timeout`: every task returns
        self._commit = threading.Lock()

    def run(self, work: Callable[[], T]) -> T:
        """`work()` on a daemon thread: its result or its error, or FetchError `timeout` at the
        deadline (the thread is left to end at its next check of `stopped`)."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = work()
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                box["error"] = e

        worker = threading.Thread(target=target, name="fetch", daemon=True)
        worker.start()
        worker.join(max(0.0, self.ends - self.clock()))
        with self._commit:
            if worker.is_alive():
                self.expired.set()
                raise FetchError("timeout", f"the fetch ran past its deadline of {self.deadline_s:g} s (--deadline; "
                                 f"{self.moved()} bytes moved): run again to resume, or raise --deadline")
        if "error" in box:
            raise box["error"]
        return box["result"]

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        """Hold while publishing: FetchError `timeout` when the fetch was already answered so."""
        with self._commit:
            if self.expired.is_set():
                raise FetchError("timeout", "the fetch ran past its deadline before it could publish")
            yield

    def stopped(self) -> bool:
        return self.expired.is_set()

    def parallel(self, tasks: list[Callable[[threading.Event], None]], concurrency: int) -> None:
        """Run `tasks` (each given the event that tells it to stop) on at most `concurrency` daemon
        threads; the first error is raised once the others were told to stop; a stall (fewer than
        `min_rate_bps` bytes a second over the last `window_s` seconds) or the deadline is FetchError
        `timeout` at once, without waiting for a task blocked in a read."""
        stop = threading.Event()
        pending = collections.deque(tasks)
        errors: list[BaseException] = []
        lock = threading.Lock()
        left = [len(tasks)]
        finished = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                with lock:
                    if not pending:
                        return
                    task = pending.popleft()
                try:
                    task(stop)
                except BaseException as e:  # noqa: BLE001 (raised on the waiting thread)
                    errors.append(e)
                    stop.set()
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()

        if not tasks:
            return
        for n in range(min(concurrency, len(tasks))):
            threading.Thread(target=worker, name=f"fetch-{n}", daemon=True).start()
        try:
            self._wait(finished, stop)
        finally:
            stop.set()
        if errors:
            raise errors[0]

    def _wait(self, finished: threading.Event, stop: threading.Event) -> None:
        samples: collections.deque[tuple[float, int]] = collections.deque([(self.clock(), self.moved())])
        while not finished.wait(POLL_S):
            if stop.is_set():  # a task failed: the others stop at their next read
                return
            if self.expired.is_set():
                raise FetchError("timeout", "the fetch ran past its deadline")
            now, moved = self.clock(), self.moved()
            samples.append((now, moved))
            while len(samples) > 1 and now - samples[1][0] >= self.window_s:
                samples.popleft()  # keep the newest sample at least a window old
            then, before = samples[0]
            if now - then >= self.window_s and moved - before < self.min_rate_bps * (now - then):
                raise FetchError("timeout", f"the store sent {moved - before} bytes in the last {now - then:.0f} s, "
                                 f"less than --min-rate {self.min_rate_bps} bytes/s over --stall-window "
                                 f"{self.window_s:g} s: it stalls; run again to resume")
