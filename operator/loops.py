"""The reconcile loop of each DLODeployment: an asyncio task the watch handlers start on the
resource's first event, wake on every change that concerns it, and cancel when it is deleted or the
operator stops.

Owns: `Loops` (the tasks, their wake-up events, each resource's latest body and generation) and
the loop itself: a round runs when woken, after `status_interval` when nothing changed (a resync),
and after `retry_seconds` when a round failed. kopf runs no daemon or timer for the resource, so it
adds no finalizer: deleting a DLODeployment never waits on a running operator (the children go
with their owner references).
Must never: reconcile anything itself (the round it is given does), or block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from dlo.operator.config import OperatorConfig

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name)
Round = Callable[[Key, dict[str, Any]], Awaitable[bool]]  # one reconcile: False when it must be retried soon


class Loops:
    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.round: Round | None = None  # set by the first handler that has kopf's indexes
        self.bodies: dict[Key, dict[str, Any]] = {}
        self.generations: dict[Key, Any] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._events: dict[Key, asyncio.Event] = {}
        self.rounds: Counter[Key] = Counter()  # rounds run, per resource (what woke them is not kept)

    def keys(self) -> list[Key]:
        return list(self._tasks)

    def seen(self, key: Key, body: dict[str, Any]) -> None:
        """The resource as its last event showed it; its loop starts on the first, and a new
        generation (a spec change) wakes it."""
        self.bodies[key] = body
        generation = body.get("metadata", {}).get("generation")
        if key not in self._tasks:
            self._events[key] = asyncio.Event()
            self._tasks[key] = asyncio.create_task(self._loop(key), name=f"reconcile {key[0]}/{key[1]}")
        elif self.generations.get(key) == generation:
            return
        self.generations[key] = generation
        self._events[key].set()

    def wake(self, key: Key) -> None:
        if key in self._events:
            self._events[key].set()

    def wake_all(self) -> None:
        for event in self._events.values():
            event.set()

    async def forget(self, key: Key) -> None:
        """The resource is gone: its loop ends (a round already in its thread finishes there)."""
        task = self._tasks.pop(key, None)
        self._events.pop(key, None)
        self.bodies.pop(key, None)
        self.generations.pop(key, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        for key in list(self._tasks):
            await self.forget(key)

    async def _loop(self, key: Key) -> None:
        wake = self._events[key]
        while True:
            wake.clear()
            ok = False
            try:
                if self.round is not None and key in self.bodies:
                    self.rounds[key] += 1
                    ok = await self.round(key, self.bodies[key])
            except Exception:  # a bug must not end the loop: logged, retried
                log.exception("reconcile round failed resource=%s/%s", *key)
            delay = self.config.status_interval if ok else self.config.retry_seconds
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=delay)
