"""The garbage collector while a rank starts.

[Note: the collector during a start]
A start is mostly imports and module builds (torch, diffusers, transformers, the pipeline), which
create a few hundred thousand long-lived objects. CPython's cyclic collector runs whenever
allocations outnumber deallocations by 700, and each run of the oldest generation scans everything
alive: measured on the 2-core dev host, the imports of a Wan pipeline ran 1,021 collections and took
3.1-5.3 s with the collector on, 2.3-2.7 s with it off, and what those collections found was 9,426
unreachable objects of 643,000 (`gc.collect()` after them: 0.36 s). So a rank starts with the
collector off (`--pause-gc-at-start`, the default) and, when its start is over (rank 0 as the
engine leaves `loading`, ranks 1.. once their warm-up wave is done, before its result is sent), runs
one collection, freezes what is left (`gc.freeze`: the start's modules and models are never scanned
again, so serving's collections stay short) and turns the collector back on (what only imports made, before any device memory, is frozen early,
`freeze_imports`: that collection then scans the load's objects only). That collection is
inside the start's seconds (rank 0: before `/ready` can answer 200), never in a request's.

Owns: `StartGC`.
Must never: leave the collector off past the start, or skip the start's collection (garbage frozen
is never freed: a device tensor in a reference cycle would stay for the process's life).
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)


class StartGC:
    """`begin()` turns the collector off (if `paused` and it is on); `end()` collects, freezes and turns
    it back on, once, from any thread."""

    def __init__(self, paused: bool):
        self.paused = paused
        self._off = False
        self._lock = threading.Lock()

    def begin(self) -> "StartGC":
        with self._lock:
            if self.paused and not self._off and gc.isenabled():
                gc.disable()
                self._off = True
        return self

    def freeze_imports(self) -> None:
        """Freeze what exists now, without a collection, so the start's collection does not scan it
        again: only where nothing but imports ran (no device memory, no model), whose garbage stays
        for good (torch's import on the dev host: 7,049 objects, 0.66 MB of 255,000; its scan 0.11 s)."""
        with self._lock:
            if self._off:
                gc.freeze()

    @property
    def active(self) -> bool:
        return self._off

    def end(self) -> None:
        with self._lock:
            if not self._off:
                return
            t0 = time.perf_counter()
            found = gc.collect()
            gc.freeze()
            gc.enable()
            self._off = False
            log.info("start over: garbage collector back on (the start's collection found %d unreachable objects "
                     "in %.2f s; %d objects frozen)", found, time.perf_counter() - t0, gc.get_freeze_count())
