"""Waves: grouping queued requests that can run together on the ranks.

Owns: the compatibility key of a request (`compatibility_key`: every field of a
`dlo.engine.request.Generation` that changes tensor shapes or the collective schedule), `Pending`
(with the trace context it was queued in: `request_trace.py`), the pure wave-forming rule
`next_wave`, `mark_caches` (a wave with a step cache says so to every rank), and `WaveQueue`, the
asyncio queue rank 0's scheduler drains (a wave taken starts its requests' wave spans).

Rules (the published system's weaknesses we do not repeat):
- a request is never rejected because of its neighbours: a request whose key differs from the
  wave being formed waits for a later wave;
- a partial wave is not padded with duplicated work: idle ranks only take part in the weight
  gathers (`gather_only`);
- the oldest request's key forms the next wave (no starvation); the wave starts when it holds dp
  requests or when the oldest has waited the batching window.
Must never: import torch, or run anything on the ranks (that is `dlo.serving.ranks`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from dlo.engine.request import Generation
from dlo.serving.errors import QueueFull
from dlo.serving.request_trace import request_context, start_wave_spans


def compatibility_key(gen: Generation) -> str:
    """Requests with equal keys run the same shapes and gather schedule: every field that changes
    tensor shapes or the collective schedule.

    Seeds, prompts and negative-prompt text may differ inside a wave; whether a negative prompt is
    present may not (it can add a CFG branch). The input image is not part of it (resized to the
    wave's size), nor is the LoRA adapter or its scale: each rank adds its own adapter's branch to
    the layers' outputs over the same gathered weights (`dlo.engine.lora`), so requests for
    different adapters (or none) share a wave.
    """
    return json.dumps(
        {
            "height": gen.height, "width": gen.width, "frames": gen.frames, "fps": gen.fps,
            "steps": gen.steps, "guidance_scale": gen.guidance_scale, "cfg": gen.guidance_scale > 1.0,
            "negative_prompt": gen.negative_prompt is not None, "n": gen.n,
            "extras": gen.extras,
        },
        sort_keys=True, separators=(",", ":"),
    )


@dataclass
class Pending:
    """A request waiting for a wave, with the future its HTTP handler awaits."""

    gen: Generation
    enqueued: float
    future: asyncio.Future | None = None
    key: str = ""
    request_id: str = ""
    trace: Any = field(default_factory=request_context)  # the HTTP request's context (None: not traced)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = compatibility_key(self.gen)


def next_wave(queue: list[Pending], dp: int, now: float, window_s: float) -> tuple[list[Pending], float | None]:
    """The next wave to start now, or ([], seconds to wait) / ([], None) when the queue is empty.

    The oldest request's key wins; the wave takes up to dp requests with that key in arrival order.
    It starts when full, or once the oldest request has waited `window_s`.
    """
    if not queue:
        return [], None
    head = queue[0]
    same = [p for p in queue if p.key == head.key][:dp]
    if len(same) >= dp:
        return same, None
    wait = head.enqueued + window_s - now
    if wait <= 0:
        return same, None
    return [], wait


def mark_caches(wave: list[Pending]) -> list[Pending]:
    """A wave where some request has a step cache: each of its requests says so
    (`Generation.wave_caches`), so that every rank of the wave, one that only gathers too, plans its
    gathers with the others' (`dlo.engine.skip_plan`). A cache is not part of the compatibility key:
    cached and uncached requests, and different presets, share waves."""
    if any(p.gen.cache is not None for p in wave):
        for p in wave:
            p.gen = dataclasses.replace(p.gen, wave_caches=True)
    return wave


class WaveQueue:
    """Requests waiting for a wave (rank 0, inside the event loop)."""

    def __init__(self, dp: int, window_s: float, max_queue: int):
        self.dp, self.window_s, self.max_queue = dp, window_s, max_queue
        self._items: list[Pending] = []
        self._changed = asyncio.Event()
        self.waves_taken = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, pending: Pending) -> None:
        if len(self._items) >= self.max_queue:
            raise QueueFull(f"{len(self._items)} requests are waiting (--max-queue {self.max_queue}); retry later")
        self._items.append(pending)
        self._changed.set()

    def remove_future(self, future: asyncio.Future) -> bool:
        """Drop the waiting request whose future this is (its client left); False if none waits."""
        kept = [p for p in self._items if p.future is not future]
        removed, self._items = len(kept) != len(self._items), kept
        return removed

    def drain(self) -> list[Pending]:
        items, self._items = self._items, []
        return items

    async def take_wave(self) -> list[Pending]:
        """Wait until a wave is due, remove it from the queue and return it."""
        while True:
            # requests whose client went away (future cancelled) never reach the ranks
            self._items = [p for p in self._items if p.future is None or not p.future.done()]
            wave, wait = next_wave(self._items, self.dp, time.monotonic(), self.window_s)
            if wave:
                ids = {id(p) for p in wave}
                self._items = [p for p in self._items if id(p) not in ids]
                self.waves_taken += 1
                start_wave_spans(wave, self.waves_taken)
                return mark_caches(wave)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass
