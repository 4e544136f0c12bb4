"""The environment of every process a `dlo serve` process starts: the ranks and the start's helpers.

Owns: `API_KEY_ENV` and `child_env` (this process's environment without the API key: rank 0 alone
answers HTTP, so no child sees the key, not even in its environment), and `die_with_parent`, what
each child runs first (the ranks 1..dp-1, `rank_main`, and the readahead's child, `readahead`).
Must never: import anything beyond the standard library (the readahead's child imports it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

log = logging.getLogger(__name__)

API_KEY_ENV = "DLO_API_KEY"


def child_env() -> dict[str, str]:
    """This process's environment without the API key."""
    return {k: v for k, v in os.environ.items() if k != API_KEY_ENV}


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (no orphans even if rank 0 is killed)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        log.warning("parent-death signal unavailable; relying on control-plane end-of-file")
