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

Owns: `start_distribution_map` (the child, started once per process), `installed` (the load's
window with the map in place).
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
from typing import Callable, Iterator

log = logging.getLogger(__name__)

WAIT_S = 10.0  # the longest the load waits for the child's map (it takes ~0.7 s on a large host)
# the child: this process's `sys.path` exactly (argv[1]), then the map as one JSON line
_CHILD = ("import importlib.metadata, json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "print(json.dumps(importlib.metadata.packages_distributions()))")

_started: subprocess.Popen | None = None


def start_distribution_map() -> None:
    """Start the child computing the map, with this process's `sys.path` (once per process)."""
    global _started
    if _started is not None:
        return
    try:
        _started = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
    except OSError as e:  # the load computes it in-process instead
        log.warning("the distribution map's process did not start: %s", e)


def _child_map() -> dict[str, list[str]] | None:
    """The child's map, None when it was not started or did not give one within `WAIT_S`."""
    global _started
    proc, _started = _started, None
    if proc is None:
        return None
    try:
        out, _ = proc.communicate(timeout=WAIT_S)
        found = json.loads(out) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError) as e:
        proc.kill()
        proc.communicate()
        log.warning("the distribution map's process gave no map (%s): computing it here", type(e).__name__)
        return None
    if not isinstance(found, dict):
        log.warning("the distribution map's process exited with code %s: computing it here", proc.returncode)
        return None
    return found


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """While the rank loads, `importlib.metadata.packages_distributions()` answers from the child's
    map (copies: a caller may change what it gets), else from one in-process call."""
    original = importlib.metadata.packages_distributions
    found = _child_map()
    replacement: Callable[[], dict[str, list[str]]]
    if found is not None:
        replacement = lambda: {name: list(dists) for name, dists in found.items()}  # noqa: E731
    else:
        once = functools.cache(original)
        replacement = lambda: {name: list(dists) for name, dists in once().items()}  # noqa: E731
    importlib.metadata.packages_distributions = replacement
    try:
        yield
    finally:
        importlib.metadata.packages_distributions = original
