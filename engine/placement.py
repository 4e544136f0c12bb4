"""A model's resident weights onto the device: its non-block tensors and the blocks it keeps.

Owns: `place_resident` (each resident tensor into its own device tensor: from the registered page
cache, asynchronously on a copy stream of its own, file by file as the early registration reaches
each file; from pageable memory, synchronously, where a file is not registered or a tensor needs a
cast; an FP8-streamed weight dequantized on the device as a streamed block's is) and `Placement`
(the bytes placed, the seconds waited for the registration, and the event the copies end with).
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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dlo.engine.checkpoint import Checkpoint, CheckpointError
from dlo.engine.dtypes import torch_dtype
from dlo.engine.model import MetaModel, move_free_buffers, owner_of, set_tensor
from dlo.engine.platform import Platform
from dlo.engine.quantize import resident_fp8
from dlo.engine.weights import EarlyRegistration


@dataclass(frozen=True)
class Placement:
    nbytes: int  # resident bytes on the device (free buffers included)
    registration_wait: float  # seconds the copies waited for the early registration to reach a file
    registered_bytes: int  # of `nbytes`, copied from registered files (asynchronously where streams exist)
    done: Any = None  # the event the asynchronous copies end with (None: every copy was synchronous)


def place_resident(ckpt: Checkpoint, meta: MetaModel, keep: set[int], device: torch.device, platform: Platform,
                   early: EarlyRegistration | None, fp8: Any = None) -> Placement:
    """Copy the non-block weights (but the family's host-only ones) and the kept blocks `keep` to the
    device and bind them (tied tensors included); `fp8`: the model's `Fp8Plan` (its weights are dequantized, synchronously,
    by `resident_fp8`); see [Note: resident copies]."""
    names = [n for n in meta.nonblock if not meta.family.on_host(n)]  # the family's host-only weights stay
    names += [k for i in sorted(keep) for k in meta.blocks[i].keys]
    quantized = set(fp8.quantized) if fp8 is not None else set()
    dst = {name: torch.empty(ckpt.tensors[name].shape, dtype=torch_dtype(meta.target_dtype[name]), device=device)
           for name in names if name not in quantized}  # rule 1: allocated first, in the model's order
    for name in (n for n in names if n in quantized):  # on the compute stream, before the copies
        dst[name] = resident_fp8(ckpt, fp8, name, device, torch_dtype(meta.target_dtype[name]))
    compute = platform.current_stream()
    lane = None
    if early is not None and platform.has_streams:
        lane = platform.new_stream("resident")
        start = platform.new_event()
        platform.record(start, compute)
        platform.wait(lane, start)
    try:
        copied = [n for n in names if n not in quantized]
        waited, registered_bytes = _copy_in_file_order(ckpt, copied, dst, platform, early, lane, compute)
    except BaseException:
        platform.synchronize()  # rule 3: nothing in flight when the caller releases the registrations
        raise
    done = None
    if lane is not None and registered_bytes:
        done = platform.new_event()
        platform.record(done, lane)
        platform.wait(compute, done)  # rule 2
        assert early is not None
        early.hold_until(done)  # rule 3
    for name in names:
        set_tensor(meta.module, name, dst[name])
    _bind_aliases(meta)
    placed = sum(t.numel() * t.element_size() for t in dst.values())
    return Placement(placed + move_free_buffers(meta.module, device, set(meta.target_dtype)), waited,
                     registered_bytes, done)


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
