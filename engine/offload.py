"""`dlo.engine.load`: a diffusers transformer whose blocks stream through two device slots.

Owns: `load` (the orchestrator: parse the checkpoint, build the model on meta, place resident
weights, prepare the host weights, start the `SlotPrefetcher`, attach its hooks, report) and
`OffloadedModel` (what callers hold: the module, the report, `gather_only`, `stats`, `close`),
which blocks stay resident (`spread_resident`), and the shard group's agreement on how many
(`agree_on_resident_blocks`; `--resident-blocks auto` itself is sized from the device budget and
the memory table before any load: `dlo.plan.memory_plan`).
Must never: run the hot path itself (`dlo.engine.prefetch` does, under its `[Note: stream
lifetimes]` and `[Note: collective order]`), or modify a module other than through `dlo.engine.hooks`.

Data path, per offloaded block b (docs/contracts.md sections 3 and 4):

    arena shard (pinned host) --H2D, copy stream--> slot[k].narrow(r*S, S)
                              --in-place AllGather, comm stream--> slot[k][0 : g*S]
    compute stream waits `ready[k]`, binds b's cached views of slot[k], runs b, records `free[k]`
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dlo.engine.checkpoint import Checkpoint, cached_checkpoint
from dlo.engine.dtypes import torch_dtype
from dlo.plan.facts import MODES, Mode
from dlo.engine.blocks import block_layout
from dlo.engine.fp8 import Fp8Plan, fp8_plan, wire_layout
from dlo.engine.hooks import HookSet, attach_prefetcher
from dlo.engine.model import MetaModel, assert_nothing_on_meta, build_meta_model, set_tensor
from dlo.engine.peergather import agree_on_path
from dlo.engine.placement import Placement, place_resident
from dlo.engine.platform import Platform, get_platform
from dlo.engine.prefetch import OffloadedBlock, PrefetchOrderError, SlotPrefetcher
from dlo.engine.quantize import InMemoryFp8
from dlo.engine.report import GatherStats, LoadReport
from dlo.engine.settings import ConfigError, OffloadSettings
from dlo.engine.timing import Laps
from dlo.engine.transfers import choose_transfer
from dlo.engine.weights import EarlyRegistration, HostWeights, ReadFront, prepare_host_weights

log = logging.getLogger(__name__)

__all__ = ["load", "early_registration", "OffloadedModel", "PrefetchOrderError", "OffloadSettings", "LoadReport",
           "GatherStats", "MODES", "Mode", "spread_resident"]

class OffloadedModel:
    """What `load` returns: the module to call, the load report, and `gather_only`."""

    def __init__(self, module: nn.Module, report: LoadReport, prefetcher: SlotPrefetcher | None,
                 host: HostWeights | None, ckpt: Checkpoint, platform: Platform, device: torch.device,
                 hooks: HookSet | None = None, compute_dtype: torch.dtype = torch.float32,
                 unsettled: EarlyRegistration | None = None, copies: Any = None):
        self.module = module
        self.host = host
        self.report = report
        self.prefetcher = prefetcher
        self.hooks = hooks if hooks is not None else HookSet()  # removed by close()
        self.platform = platform
        self.device = device
        self._ckpt = ckpt  # keeps the page-cache mappings alive for the model's lifetime
        self.compute_dtype = compute_dtype  # what most weights compute in (`_compute_dtype`)
        # the resident copies still in flight (their event) and the registrations they read (`settle`)
        self._copies, self._unsettled = copies, unsettled
        self._releasing: threading.Thread | None = None  # the registrations' release after `settle`

    def gather_only(self, n_calls: int) -> None:
        """Take part in n_calls forwards' weight gathers without compute (same collective order)."""
        if self.prefetcher is None:
            return
        for _ in range(n_calls):
            self.prefetcher.gather_only()

    def order_intact(self) -> bool:
        """Whether the gather order still holds: no forward stopped between blocks and no gather
        failed ([Note: collective order]). False means the engine must restart: gathers may be in
        flight and the shard group's ranks no longer agree on the next one. Always True without
        offload (resident)."""
        return self.prefetcher is None or self.prefetcher.between_forwards

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype tensor `name` (a checkpoint key) computes in: a streamed block's tensors are
        placeholders between forwards (their slot views carry the real dtype), the others are real."""
        if self.prefetcher is not None:
            for b in self.prefetcher.blocks:
                for t in b.layout.tensors:
                    if t.name == name:
                        return torch_dtype(t.dtype)
        return self.module.get_parameter(name).dtype

    def streamed_modules(self) -> dict[nn.Module, int]:
        """Every module inside a streamed block, by its block's index: its weights are slot views while it
        runs (rebound each forward), placeholders between; the others' stay where they were placed."""
        if self.prefetcher is None:
            return {}
        return {m: i for i, b in enumerate(self.prefetcher.blocks) for m in b.module.modules()}

    def stats(self) -> GatherStats:
        """The cumulative counters now (gathers, H2D bytes, collective bytes, gather wait seconds)."""
        if self.prefetcher is None:
            return GatherStats()
        self.prefetcher.collect_waits()
        return self.prefetcher.stats

    def settle(self) -> float:
        """After `load(settle=False)`: wait until its resident copies are issued, order the compute stream
        after them (`ResidentCopies.finish`), and release the registrations they read (those no host
        weights kept) on a thread once they land (`close()` joins it). Returns the seconds. Idempotent."""
        t0 = time.perf_counter()
        if self._copies is not None:
            copies, self._copies = self._copies, None
            copies.finish()
            if copies.in_background:
                log.info("resident copies issued beside the load: %d bytes from registered files in %.2f s "
                         "(%.2f s of it waiting for the registration)", copies.registered_bytes,
                         copies.issue_seconds, copies.registration_wait)
        if self._unsettled is not None:
            registration, self._unsettled = self._unsettled, None
            self._releasing = threading.Thread(target=_release_logged, args=(registration,), daemon=True,
                                               name="dlo-unregister")
            self._releasing.start()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Remove DLO's hooks and release DMA registrations (after in-flight copies finish). The
        model is unusable after."""
        self.settle()
        if self._releasing is not None:
            self._releasing.join()
        self.hooks.remove()
        if self.prefetcher is not None:
            self.prefetcher.release()
        if self.host is not None and self.host.pinned:
            self.platform.synchronize()
            self.host.release()


def load(component_dir: Path | str, *, settings: OffloadSettings, device: torch.device | str, group: Any = None,
         early: EarlyRegistration | None = None, settle: bool = True) -> OffloadedModel:
    """Load a diffusers transformer folder for layerwise offload, as `settings` say.

    Builds the model on `meta`, validates the checkpoint against it (`CheckpointError` naming file
    and key on any mismatch), puts non-block weights (and `settings.resident_blocks` blocks) on the
    device, and streams the other blocks through two device slots: `allgather` shards every block
    over the ranks of `group` (None: the default group) and rebuilds it on the device with an
    in-place AllGather (or peer copies: `settings.transfer`); `rank-local` copies whole blocks from
    this rank's own host source; `resident` puts everything on the device (the baseline).
    `settings.weights` picks the host source of block bytes: `registered` (the page cache itself,
    DMA-registered: no arena), `arena` (one pinned copy of this rank's shards), or `auto`
    (registered where the platform allows it, else the arena; the report says which and the log
    says why). Resident blocks are spread evenly through the execution order (`spread_resident`);
    `settings.resident_blocks` is a number here ("auto" is sized by the caller, who knows the
    requests: `dlo.plan.memory_plan`). `early`: the registration of this folder's files already started by the
    caller (`early_registration`, to overlap it with the caller's own imports); else one starts here
    where it can help, so that the driver pins the page cache while the model is built and the
    resident copies run at DMA speed ([Note: resident copies] in `dlo.engine.placement`).
    `settle=False` returns while those copies may still run, or, with no block streamed, while a
    thread still issues them: nothing may read the model's tensors before `OffloadedModel.settle()`,
    which orders the stream current at load after them and releases the registrations they read
    (those no host weights kept); `close()` does too.
    """
    t0 = time.perf_counter()
    laps = Laps(t0)  # where the load's time goes (the `phases=` of its log line)
    device = torch.device(device)
    platform = get_platform(device)
    if early is None:
        early = early_registration(component_dir, device, settings)
    host: HostWeights | None = None
    placed: Placement | None = None
    try:
        ckpt, meta = _parse_and_build(component_dir, early, laps)
        fp8 = fp8_plan(ckpt, (k for b in meta.blocks for k in b.keys), settings.stream_dtype)
        keep = spread_resident(len(meta.blocks), _resident_count(settings, len(meta.blocks)))
        offloaded = [b for i, b in enumerate(meta.blocks) if i not in keep]
        # with nothing streamed, no graph is captured: the copies are issued beside the caller's next steps
        background = not offloaded and not settle
        placed, host_only_bytes = _place_resident_weights(ckpt, meta, keep, device, platform, early, laps, fp8,
                                                          background)
        wires = [_wire(ckpt, b, meta, fp8) for b in offloaded]
        layouts = [lay for lay, _ in wires]
        g, r = _shard_group(settings.mode, group)
        stream = None
        if offloaded:  # the host weights adopt the registrations they use and release the rest
            derived = InMemoryFp8(ckpt, dict(fp8.quantized)).bytes_of if fp8 is not None and not fp8.stored else None
            host = prepare_host_weights(ckpt, layouts, meta.target_dtype, g, r, platform, settings.weights, early,
                                        derived=derived)
            laps.lap("host_weights")
            stream = _start_streaming(meta, offloaded, wires, host, settings, platform, device, group, g, r)
            laps.lap("slots")
    except BaseException:
        _release_after_failure(placed, host, early)
        raise
    assert_nothing_on_meta(meta.module, {k for b in offloaded for k in b.keys})
    prefetcher, hooks = stream if stream is not None else (None, HookSet())
    _attach_host_lookups(meta, device, hooks)
    report = _load_report(settings, ckpt, placed, host, prefetcher, layouts, len(keep), (g, r), host_only_bytes, t0)
    log.info("dlo loaded %s phases=%s", " ".join(f"{k}={v}" for k, v in report.to_dict().items()), laps.rounded())
    # what no host weights adopted stays registered until the copies that read it have landed
    model = OffloadedModel(meta.module, report, prefetcher, host, ckpt, platform, device, hooks,
                           compute_dtype=_compute_dtype(meta, ckpt), unsettled=early, copies=placed.copies)
    if settle:
        model.settle()
    return model


def _load_report(settings: OffloadSettings, ckpt: Checkpoint, placed: Placement, host: HostWeights | None,
                 prefetcher: SlotPrefetcher | None, layouts: list[Any], resident_blocks: int, group_rank: tuple[int, int],
                 host_only_bytes: int, t0: float) -> LoadReport:
    """Step 4: what the load did (the `dlo loaded` line and `OffloadedModel.report`)."""
    g, r = group_rank
    return LoadReport(
        mode=settings.mode, weights_source=host.source if host else "resident", blocks=len(layouts),
        largest_block_bytes=max((lay.nbytes for lay in layouts), default=0),
        host_pinned_bytes=host.pinned_bytes if host else 0, slot_bytes=prefetcher.device_bytes if prefetcher else 0,
        resident_bytes=placed.nbytes, load_seconds=time.perf_counter() - t0, shard_group_size=g, rank=r,
        resident_blocks=resident_blocks, pinned=bool(host and host.pinned),
        transfer=prefetcher.transfer.name if prefetcher else "none", model_bytes=ckpt.nbytes,
        host_only_bytes=host_only_bytes,
    )


def _release_logged(registration: EarlyRegistration) -> None:
    t0 = time.perf_counter()
    registration.release()
    log.info("page-cache registrations the resident copies read released in %.2f s", time.perf_counter() - t0)


def _release_after_failure(placed: Placement | None, host: HostWeights | None,
                           early: EarlyRegistration | None) -> None:
    """A load that failed part-way (the slots did not fit, say): once no copy still reads them, nothing
    stays registered or pinned."""
    if placed is not None:
        placed.copies.land()
    if host is not None:
        host.release()
    if early is not None:
        early.release()


def _parse_and_build(component_dir: Path | str, early: EarlyRegistration | None, laps: Laps) -> tuple[Checkpoint, MetaModel]:
    """Step 1: parse the checkpoint (once per process) and build the model on meta, validating the
    checkpoint against the model."""
    ckpt = early.ckpt if early is not None else cached_checkpoint(component_dir)
    laps.lap("checkpoint")
    meta = build_meta_model(component_dir, ckpt)
    laps.lap("meta_model")
    return ckpt, meta


def _place_resident_weights(ckpt: Checkpoint, meta: MetaModel, keep: set[int], device: torch.device,
                            platform: Platform, early: EarlyRegistration | None, laps: Laps,
                            fp8: Fp8Plan | None = None, background: bool = False) -> tuple[Placement, int]:
    """Step 2: the family's host-only weights as page-cache views, then the non-block weights and
    the kept blocks onto the device (from the registered page cache, asynchronously, where the early
    registration reached their files; FP8 weights dequantized as streamed ones are, so every mode
    computes with the same values: `dlo.engine.placement`); returns the placement and the host-only
    bytes."""
    host_only = _keep_on_host(ckpt, meta)  # first: a tied tensor may point at one of them
    placed = place_resident(ckpt, meta, keep, device, platform, early, fp8, background)
    laps.lap("resident_copies")
    laps.phases["resident_alloc"] = placed.alloc_seconds  # inside resident_copies
    if not placed.copies.in_background:  # else the settle's log line says
        laps.phases["registration_wait"] = placed.copies.registration_wait  # inside resident_copies
    return placed, host_only


def _wire(ckpt: Checkpoint, block: Any, meta: MetaModel, fp8: Fp8Plan | None) -> tuple[Any, tuple[Any, ...]]:
    """A streamed block's slot layout, and where its FP8 weights are dequantized to (none without FP8)."""
    if fp8 is None:
        return block_layout(ckpt, block, meta.target_dtype), ()
    return wire_layout(ckpt, block.keys, meta.target_dtype, fp8)


def _start_streaming(meta: MetaModel, offloaded: list[Any], wires: list[tuple[Any, tuple[Any, ...]]],
                     host: HostWeights, settings: OffloadSettings, platform: Platform, device: torch.device,
                     group: Any, g: int, r: int) -> tuple[SlotPrefetcher, HookSet]:
    """Step 3: how blocks move (`choose_transfer`, once, for every streamed block), the slot
    prefetcher over the streamed blocks, and its hooks on the module."""
    blocks = [OffloadedBlock(meta.block_module(b), lay, lay.shard_bytes(g), dequant=pieces)
              for b, (lay, pieces) in zip(offloaded, wires)]
    if settings.mode == "allgather" and g > 1:  # the same transfer on every rank of the shard group
        agree_on_path(group, device, settings.transfer)
    else:  # nothing to gather from peers: one rank, or no collective
        settings = settings.but(transfer="collective")
    transfer = choose_transfer(settings, platform, group, g)
    prefetcher = SlotPrefetcher(meta.module, blocks, host.copies, transfer=transfer, settings=settings,
                                platform=platform, device=device, g=g, r=r, group=group)
    hooks = HookSet()
    attach_prefetcher(prefetcher, hooks)
    return prefetcher, hooks


def _compute_dtype(meta: MetaModel, ckpt: Checkpoint) -> torch.dtype:
    """The dtype most of the model's weights compute in (by stored elements), streamed blocks included:
    what the pipeline's other components load in. Not the first parameter's (models keep norms and
    time embeddings in float32) nor the module's visible parameters' (streamed blocks are not among
    them): either loaded a 5.7B text encoder in float32 beside a bfloat16 transformer."""
    totals: dict[str, int] = {}
    for name, dt in meta.target_dtype.items():
        totals[dt] = totals.get(dt, 0) + math.prod(ckpt.tensors[name].shape)
    return torch_dtype(max(totals, key=lambda d: totals[d])) if totals else torch.float32


def _resident_count(settings: OffloadSettings, n_blocks: int) -> int:
    """How many blocks stay on the device (all of them in `resident` mode)."""
    if settings.mode == "resident":
        return n_blocks
    if settings.resident_blocks == "auto":
        raise ConfigError("resident_blocks 'auto' is sized from the device budget and the largest accepted request "
                          "(dlo serve does it: dlo.plan.memory_plan); dlo.engine.load takes a number of blocks")
    return min(settings.resident_blocks, n_blocks)


def agree_on_resident_blocks(counts: dict[str, int], mode: str, group: Any, device: torch.device) -> dict[str, int]:
    """Per model, the smallest count of the shard group's ranks in allgather mode (every rank must
    stream the same blocks: the same collectives); the counts as they are otherwise."""
    if mode != "allgather" or not dist.is_initialized() or dist.get_world_size(group) <= 1 or not counts:
        return counts
    names = sorted(counts)
    agreed = torch.tensor([counts[n] for n in names], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return dict(zip(names, (int(v) for v in agreed.tolist())))


def early_registration(component_dir: Path | str, device: torch.device | str,
                       settings: OffloadSettings, after: ReadFront | None = None) -> EarlyRegistration | None:
    """Start registering `component_dir`'s files for DMA now (a thread), on a platform that
    registers host memory, unless the weights are forced into the arena or `settings.register_early`
    is off (`--no-register-early`, `DLO_REGISTER_EARLY=0`: the files are then registered in order
    when the host weights are prepared, and the resident copies go through pageable memory). Pass
    the result to `load(early=...)`. `after`: a cold start's readahead, which registering follows
    (`EarlyRegistration`: each file once the readahead has read it; the readahead reads the start's
    other files first).

    Every mode registers, `resident` included: the resident copies read the registered page cache
    (~55 GB/s on an H200 against ~7.5 GB/s pageable: 0.75 s instead of 5.3 s for Wan2.1's 40 GB) and
    run beside the rest of the start ([Note: resident copies]). What it costs the host: the model's
    files stay pinned from the start until the copies land (a `resident` load then unregisters them
    all; the streaming modes keep them for good, as before). Pinning adds no memory - the copies
    read the same page-cache pages either way - it keeps them from being reclaimed meanwhile."""
    device = torch.device(device)
    platform = get_platform(device)
    if not platform.registers_host_memory or settings.weights == "arena" or not settings.register_early:
        return None
    if device.index is None and device.type == "cuda":  # the thread registers under the caller's device
        device = torch.device("cuda", torch.cuda.current_device())
    return EarlyRegistration(cached_checkpoint(component_dir), platform, device, after=after)


def _keep_on_host(ckpt: Checkpoint, meta: MetaModel) -> int:
    """The family's `unused` and `host_lookups` weights as views of the host page cache (a copy
    only where the compute dtype differs from the stored one); returns their bytes."""
    kept = 0
    for name in meta.nonblock:
        if meta.family.on_host(name):
            value = ckpt.view(name).to(dtype=torch_dtype(meta.target_dtype[name]))
            set_tensor(meta.module, name, value)
            kept += value.numel() * value.element_size()
    return kept


def _attach_host_lookups(meta: MetaModel, device: torch.device, hooks: HookSet) -> None:
    """Each `host_lookups` embedding runs on the host: its indices come to the host, its rows go to
    `device` (the lookup is a copy of rows: the same bytes as on the device)."""
    for path in meta.family.host_lookups:
        table = meta.module.get_submodule(path)
        hooks.add_pre(table, lambda _m, args: (args[0].to("cpu"), *args[1:]))
        hooks.add_post(table, lambda _m, _args, out: out.to(device))


def _shard_group(mode: Mode, group: Any) -> tuple[int, int]:
    """(g, r): ranks sharing the weights and this rank's index among them (1, 0 unless allgather)."""
    if mode != "allgather":
        return 1, 0
    if not dist.is_initialized():
        raise RuntimeError("mode 'allgather' needs torch.distributed initialised (world size 1 is fine)")
    return dist.get_world_size(group), dist.get_rank(group)


def spread_resident(n_blocks: int, k: int) -> set[int]:
    """Which k of n blocks stay resident: spread evenly through the execution order.

    A resident block computes while the next offloaded block's transfer is in flight, so spreading
    them hides transfers; keeping the first k resident instead leaves the copy engine idle through
    them and every later block transfer-bound (measured: 40 Wan-14B blocks, k = 20, image
    workload: first-k 367 ms vs resident 249 ms).
    """
    if k <= 0:
        return set()
    if k >= n_blocks:
        return set(range(n_blocks))
    return {n_blocks - 1 - (j * n_blocks) // k for j in range(k)}
