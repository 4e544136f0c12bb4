"""A model's resident weights onto the device: its non-block tensors and the blocks it keeps.

Owns: `place_resident` (each resident tensor into its own device tensor: from the registered page
cache, asynchronously on a copy stream of its own, file by file as the early registration reaches
each file; from pageable memory, synchronously, where a file is not registered or a tensor needs a
cast; an FP8-streamed weight dequantized on the device as a streamed block's is), `Placement` (the
bytes placed, the seconds allocating) and `ResidentCopies` (the copies: issued before
`place_resident` returns, or on a thread of their own beside the caller's next steps).
Must never: let a file be unregistered while a copy still reads it (`EarlyRegistration.hold_until`
gets the copies' event), give a tensor other bytes or another dtype than `.to(device, dtype)`
would (outputs stay bit-identical to the synchronous path), or let the compute stream run ahead of
a copy in flight.

[Note: resident copies]
The pageable path (`tensor.to(device)`) runs through the driver's staging buffers at a fraction of
the link (7.5 GB/s measured for a resident Wan2.1 load on an H200, against ~55 GB/s from registered
memory) and holds the host until each copy lands. From registered files the copies are queued on a
copy stream and the host goes on (the pipeline builds its other components meanwhile). Three rules:
1. Every destination tensor is allocated, as before and in the same order, on the stream current at
   load (the compute stream); the copy stream first waits for that stream, so no earlier work still
   uses memory the allocator hands out again. Nothing is freed while the copies are issued.
2. The compute stream waits for the copies' event before anything after the load: a forward, or a
   synchronous copy of the caller, never reads a tensor whose bytes are still in flight. The
   tensors are freed (at close) on the compute stream, after that wait: no `record_stream` needed.
3. The registered files stay registered until the event has completed: `EarlyRegistration`'s
   release waits for it (`Platform.host_wait`), and a load that fails mid-way synchronises first.

Issuing the copies held the load thread 0.56 s for a resident Wan2.1 transformer's copies
(28.6 GB: about the link's time for them) where the text encoder's 11.4 GB on a stream of its own
took 0.02 s (H200, `ready-h200-2026-12-03-m`). With `background` (a model with no streamed block:
nothing captures a graph while they are issued) a thread issues them, each copy's C++ without the
GIL, while the load goes on building the next model and the pipeline: 0.18-0.21 s on that thread,
0.05 s left on the load's, and nothing to wait for at the settle (call n). `ResidentCopies.finish()`
(at `settle`, or when a load fails) joins it, and only then are rules 2 and 3 applied: the compute
stream waits for the copies' event before anything reads a resident tensor. Between the load and
`finish()` the caller queues no work that reads the model's resident tensors.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dlo.engine.checkpoint import Checkpoint, CheckpointError
from dlo.engine.dtypes import torch_dtype
from dlo.engine.model import MetaModel, move_free_buffers, owner_of, set_tensor
from dlo.engine.platform import Platform
from dlo.engine.quantize import resident_fp8
from dlo.engine.weights import EarlyRegistration


class ResidentCopies:
    """The copies of one placement from the page cache (`issue` returns the seconds it waited for
    the registration and the bytes it copied from registered files), issued now or, with
    `background`, on a thread of their own. `finish()` waits until every copy is issued (re-raising
    the issuer's error after synchronising: rule 3), then orders `compute` after the copies on
    `lane` (rule 2) and fences the registrations (rule 3); it returns the copies' event (None: every
    copy was synchronous). Idempotent."""

    def __init__(self, issue: Callable[[], tuple[float, int]], platform: Platform, early: EarlyRegistration | None,
                 lane: Any, compute: Any, device: torch.device, background: bool):
        self.platform, self.early, self.lane, self.compute = platform, early, lane, compute
        self.registration_wait, self.registered_bytes = 0.0, 0
        self.issue_seconds = 0.0  # the issuing's own seconds (beside the load when in the background)
        self.done: Any = None
        self._error: BaseException | None = None
        self._finished = False
        self._thread: threading.Thread | None = None
        if background:
            def run() -> None:
                platform.device(device.index or 0)  # this rank's device, and its compute stream current
                platform.set_stream(compute)
                self._issue(issue)

            self._thread = threading.Thread(target=run, name="dlo-resident-copies", daemon=True)
            self._thread.start()
        else:
            self._issue(issue)
            self.finish()

    @property
    def in_background(self) -> bool:
        return self._thread is not None

    def _issue(self, issue: Callable[[], tuple[float, int]]) -> None:
        t0 = time.perf_counter()
        try:
            self.registration_wait, self.registered_bytes = issue()
        except BaseException as e:  # re-raised by finish() on the caller's thread
            self._error = e
        self.issue_seconds = time.perf_counter() - t0

    def finish(self) -> Any:
        if self._finished:
            return self.done
        if self._thread is not None:
            self._thread.join()
        self._finished = True
        if self._error is not None:
            self.platform.synchronize()  # rule 3: nothing in flight when the caller releases the registrations
            raise self._error
        if self.lane is not None and self.registered_bytes:
            self.done = self.platform.new_event()
            self.platform.record(self.done, self.lane)
            self.platform.wait(self.compute, self.done)  # rule 2
            assert self.early is not None
            self.early.hold_until(self.done)  # rule 3
        return self.done

    def land(self) -> None:
        """After a failed load: block the host until no copy is in flight (an issuing error was
        raised by `finish` already, after synchronising)."""
        try:
            done = self.finish()
        except BaseException:
            return
        if done is not None:
            self.platform.host_wait(done)


@dataclass(frozen=True)
class Placement:
    nbytes: int  # resident bytes on the device (free buffers included)
    alloc_seconds: float  # allocating the destination tensors (rule 1), before any copy
    copies: ResidentCopies


def place_resident(ckpt: Checkpoint, meta: MetaModel, keep: set[int], device: torch.device, platform: Platform,
                   early: EarlyRegistration | None, fp8: Any = None, background: bool = False) -> Placement:
    """Copy the non-block weights (but the family's host-only ones) and the kept blocks `keep` to the
    device and bind them (tied tensors included); `fp8`: the model's `Fp8Plan` (its weights are dequantized, synchronously,
    by `resident_fp8`); `background`: the copies are issued on a thread (the caller must
    `copies.finish()` before anything reads the tensors or captures a graph); see [Note: resident copies]."""
    t0 = time.perf_counter()
    names = [n for n in meta.nonblock if not meta.family.on_host(n)]  # the family's host-only weights stay
    names += [k for i in sorted(keep) for k in meta.blocks[i].keys]
    quantized = set(fp8.quantized) if fp8 is not None else set()
    dst = {name: torch.empty(ckpt.tensors[name].shape, dtype=torch_dtype(meta.target_dtype[name]), device=device)
           for name in names if name not in quantized}  # rule 1: allocated first, in the model's order
    for name in (n for n in names if n in quantized):  # on the compute stream, before the copies
        dst[name] = resident_fp8(ckpt, fp8, name, device, torch_dtype(meta.target_dtype[name]))
    alloc_seconds = time.perf_counter() - t0
    compute = platform.current_stream()
    lane = None
    if early is not None and platform.has_streams:
        lane = platform.new_stream("resident")
        start = platform.new_event()
        platform.record(start, compute)
        platform.wait(lane, start)
    copied = [n for n in names if n not in quantized]
    copies = ResidentCopies(lambda: _copy_in_file_order(ckpt, copied, dst, platform, early, lane, compute),
                            platform, early, lane, compute, device, background and lane is not None)
    for name in names:
        set_tensor(meta.module, name, dst[name])
    _bind_aliases(meta)
    placed = sum(t.numel() * t.element_size() for t in dst.values())
    return Placement(placed + move_free_buffers(meta.module, device, set(meta.target_dtype)), alloc_seconds, copies)


def _copy_in_file_order(ckpt: Checkpoint, names: list[str], dst: dict[str, torch.Tensor], platform: Platform,
                        early: EarlyRegistration | None, lane: Any, compute: Any) -> tuple[float, int]:
    """The copies, in the order the registration reaches the files (file, then offset): each file's
    tensors go asynchronously on `lane` once the file is registered (a tensor that needs a dtype cast
    and the files that are not registered go synchronously).
    Returns (seconds waited for the registration, bytes copied from registered files)."""
    rank = {path: i for i, path in enumerate(ckpt.files)}
    order = sorted(names, key=lambda n: (rank[ckpt.tensors[n].path], ckpt.tensors[n].start))
    registered: dict[Any, bool] = {}
    waited, registered_bytes = 0.0, 0
    for name in order:
        path = ckpt.tensors[name].path
        if path not in registered:
            t0 = time.perf_counter()
            registered[path] = early is not None and lane is not None and early.wait_for(path)
            waited += time.perf_counter() - t0
        src = ckpt.view(name)
        if registered[path] and src.dtype == dst[name].dtype:
            platform.set_stream(lane)
            try:
                dst[name].copy_(src, non_blocking=True)
            finally:
                platform.set_stream(compute)
            registered_bytes += ckpt.tensors[name].nbytes
        else:  # pageable, or a cast: converted on the host as `.to(device, dtype)` does, synchronously
            dst[name].copy_(src)
    return waited, registered_bytes


def _bind_aliases(meta: MetaModel) -> None:
    """Tied tensors (stored once) point at the placed tensor of the name they share."""
    for alias, primary in meta.aliases.items():
        if primary not in meta.nonblock:
            raise CheckpointError(alias, f"tied to {primary!r}, a streamed block tensor: tied block weights are not supported")
        owner, attr, is_param = owner_of(meta.module, primary)
        value = owner._parameters[attr] if is_param else owner._buffers[attr]
        set_tensor(meta.module, alias, value.data)
