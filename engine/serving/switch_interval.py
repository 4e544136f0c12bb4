"""The interpreter's thread switch interval while a rank starts.

[Note: the start's switch interval]
A start runs threads beside the one that loads: the early registrations, the library warm-up, the
resident copies, the HTTP server answering probes, and the warm-up's decode beside its denoising
(`warm_run`). CPython hands the GIL to a waiting thread only when its holder blocks or after
`sys.getswitchinterval()` (5 ms by default), so a thread whose work is many short calls that
release the GIL (a VAE decode's kernel launches and cuDNN calls, a model's copies) waits up to that
long after each one while another thread runs Python (imports, module building, the denoising
beside): its seconds grow by calls x interval, not by its own work. Measured on the 2-core dev host
(400 small matmuls, each releasing the GIL, beside a Python loop): 0.13-0.18 s alone, 2.49 s beside
at 5 ms, 0.59 s at 1 ms, 0.38 s at 0.5 ms. So a rank starts at `--start-switch-interval`
(0.0005 s by default) and gets the interpreter's own interval back when its start ends: rank 0 when
the engine leaves `loading` (ready or failed), ranks 1.. once their warm-up wave is done (or before
their first request when there is none). Serving runs at the interpreter's default.

Owns: `StartSwitchInterval`.
Must never: change what any thread computes (only when a waiting thread gets the GIL), or stay
lowered past the start.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)

START_SWITCH_INTERVAL_S = 0.0005  # `--start-switch-interval`'s default


class StartSwitchInterval:
    """`begin()` sets the interval (None: the interpreter's own, nothing changes); `end()` puts the
    previous one back, once, from any thread."""

    def __init__(self, seconds: float | None):
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a switch interval must be > 0 seconds, got {seconds}")
        self.seconds = seconds
        self._previous: float | None = None
        self._lock = threading.Lock()

    def begin(self) -> "StartSwitchInterval":
        with self._lock:
            if self.seconds is not None and self._previous is None:
                self._previous = sys.getswitchinterval()
                sys.setswitchinterval(self.seconds)
        return self

    @property
    def active(self) -> bool:
        return self._previous is not None

    def end(self) -> None:
        with self._lock:
            if self._previous is None:
                return
            sys.setswitchinterval(self._previous)
            log.info("start over: thread switch interval back to %.1f ms (the start ran at %.2f ms)",
                     self._previous * 1e3, (self.seconds or 0.0) * 1e3)
            self._previous = None
