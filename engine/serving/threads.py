"""Blocking work of rank 0's event loop, run beside it: the rank group's start, waves and stop.

Owns: `in_daemon_thread` (a future the loop awaits, settled from a daemon thread).
Must never: run on a non-daemon thread - a rank stuck in a collective must never block process exit.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run fn in a daemon thread: a rank stuck in a collective must never block process exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            res = fn()
        except BaseException as e:  # handed to the awaiting coroutine
            outcome: tuple[Any, BaseException | None] = (None, e)
        else:
            outcome = (res, None)
        try:
            loop.call_soon_threadsafe(_settle, fut, *outcome)
        except RuntimeError:  # the loop closed (an abandoned wave at exit): nobody awaits it
            pass

    threading.Thread(target=target, name="wave", daemon=True).start()
    return fut
