"""Process-tree checks shared by the reliability tests (not a test module)."""

from __future__ import annotations

import time

import psutil


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(procs: list[psutil.Process], seconds: float) -> list[int]:
    """Pids of `procs` still alive once all are gone or `seconds` passed (zombies count as gone)."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p.pid for p in procs if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
