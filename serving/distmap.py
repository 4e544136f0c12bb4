"""The installed distributions' import-name map, computed beside a rank's start for the libraries
that ask for it at import time.

[Note: packages_distributions at import]
diffusers (`diffusers.utils.import_utils`) and transformers up to 5.2x (`transformers.utils.
import_utils`) each call `importlib.metadata.packages_distributions()` when they are imported. It
reads every installed distribution's file list: on the GPU host's ~250 distributions each call
took 0.68 s of a warm start (py-spy, `ready-h200-2026-12-01-c`), twice per start, in GIL-bound
Python beside which nothing else runs. The map depends only on what is installed, so a child
process computes it once from the first steps of the start (`start_distribution_map`: beside the
server's own imports of torch and the HTTP stack, seconds before the libraries ask), and while the
rank loads (`installed`) `importlib.metadata.packages_distributions` returns copies of that map;
the function is restored afterwards. Without the child's answer (it failed, or timed out) the map
is computed once in-process and reused for the second call.

Owns: `start_distribution_map` (the child, started once per process, reaped by a thread of its
own), `installed` (the load's window with the map in place, asked of the child on first use).
Must never: change the map's content (the child reads the same `sys.path`), keep the function
replaced beyond the window, or make a start fail (a failed child costs what it would have saved).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import subprocess
import sys
import threading
from typing import Iterator

log = logging.getLogger(__name__)

WAIT_S = 10.0  # the longest the first caller waits for the child's map (it takes ~0.7 s on a large host)
# the child: this process's `sys.path` exactly (argv[1]), then the map as one JSON line
_CHILD = ("import importlib.metadata, json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "print(json.dumps(importlib.metadata.packages_distributions()))")


class _ChildMap:
    """The child computing the map, and a daemon thread that waits for it (so it is reaped whether
    or not a load ever asks); `get()` waits for its answer, `WAIT_S` at most (None: no answer)."""

    def __init__(self) -> None:
        from dlo.serving.child_env import child_env

        self.found: dict[str, list[str]] | None = None
        self.why = ""
        self._done = threading.Event()
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path)], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=child_env())
        threading.Thread(target=self._wait, name="dlo-distmap", daemon=True).start()

    def _wait(self) -> None:
        try:
            out, _ = self._proc.communicate()
            found = json.loads(out) if self._proc.returncode == 0 else None
            if isinstance(found, dict):
                self.found = found
            elif not self.why:  # a timeout's reason stays
                self.why = f"exited with code {self._proc.returncode}" if self._proc.returncode else "gave no map"
        except ValueError:
            self.why = self.why or "gave no map"
        finally:
            self._done.set()

    def get(self) -> dict[str, list[str]] | None:
        if not self._done.wait(WAIT_S):
            self.why = f"gave no map within {WAIT_S:.0f} s"
            self._proc.kill()  # the reader thread reaps it
            return None
        return self.found


_started: _ChildMap | None = None


def start_distribution_map() -> None:
    """Start the child computing the map, with this process's `sys.path` (once per process)."""
    global _started
    if _started is not None:
        return
    try:
        _started = _ChildMap()
    except OSError as e:  # the load computes it in-process instead
        log.warning("the distribution map's process did not start: %s", e)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """While the rank loads, `importlib.metadata.packages_distributions()` answers from the child's
    map (copies: a caller may change what it gets; asked for on the first call, not before), else
    from one in-process call. Restored on the way out unless someone replaced it meanwhile."""
    global _started
    child, _started = _started, None
    original = importlib.metadata.packages_distributions

    @functools.cache
    def the_map() -> dict[str, list[str]]:
        found = child.get() if child is not None else None
        if child is not None and found is None:
            log.warning("the distribution map's process %s: computing it here", child.why)
        return found if found is not None else original()

    def replacement() -> dict[str, list[str]]:
        return {name: list(dists) for name, dists in the_map().items()}

    importlib.metadata.packages_distributions = replacement
    try:
        yield
    finally:
        if importlib.metadata.packages_distributions is replacement:
            importlib.metadata.packages_distributions = original
