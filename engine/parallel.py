"""Ranks of a node as dp x sp: which rank shards what, runs which request, talks to whom.

Owns: `Layout` (the pure rank arithmetic of a node of N = dp x sp ranks: sequence-parallel groups
are consecutive ranks `[d*sp, (d+1)*sp)`, the shard group is all N ranks), its validation
(`check_layout`, `check_tokens`), the wave mapping (`wave_assignments`, `leader_results`), and on
the torch side `ParallelGroups` (`make_groups`: the device mesh and the sp process group, built
identically on every rank), `enable_sequence_parallel` (diffusers' context parallelism on a
model, offloaded or not) and `sp_group_of` (the sp group a model's sequence is split over).
Must never: import torch at module level (the serving side's torch-free modules import the
layout), or put a collective of the sp group inside the weight plane's order: the weight gathers
run over the shard group (all ranks, `dlo.engine.prefetch`), the all-to-alls of sequence
parallelism over the sp group only, so an idle sp group gathers and nothing else.

Why diffusers' context parallelism composes with the offload: its hooks sit at the model
boundary (split the inputs of `blocks.0`, the rope outputs and the timestep; gather the output of
`proj_out`, per the model's `_cp_plan`) and inside attention (the Ulysses all-to-all, or the ring);
ours bind each block's parameters in a forward pre-hook. Neither touches what the other binds, and
PyTorch runs our pre-hook before diffusers' wrapped forward, so each rank computes its slice of the
sequence with the full block weights its gathers rebuilt.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from dlo.engine.settings import SP_KINDS, ULYSSES_EXCHANGES, ConfigError, ParallelSettings, SpKind, UlyssesExchange

log = logging.getLogger(__name__)

# `ParallelSettings.gather_max_ctas` (`--gather-max-ctas`, DLO_GATHER_MAX_CTAS): the weight gathers'
# NCCL communicator may use at most this many CTAs (SMs); unset, NCCL chooses. With sp the gathers
# share the GPUs' SMs and NVLink with the compute and Ulysses' all-to-alls; a block's gather needs
# ~9 GB/s against ~80 ms of compute, which a few CTAs carry (record `h200x2-sp-2026-11-30-40l`: DLO +
# Ulysses-2 was 1.0079x resident Ulysses-2). Measured before it becomes a default.

T = TypeVar("T")


class LayoutError(ConfigError):
    """A dp x sp layout (or a request) the node cannot run; the message says why in one line."""


@dataclass(frozen=True)
class Layout:
    """N = dp x sp ranks of one node. Rank r runs request slot `r // sp` of a wave, as member
    `r % sp` of its sp group; its shard of every block is shard `r` of N (docs/contracts.md section 4,
    g = dp x sp)."""

    dp: int = 1
    sp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.sp

    def sp_ranks(self, d: int) -> list[int]:
        """The ranks of sp group d (consecutive)."""
        if not 0 <= d < self.dp:
            raise IndexError(f"sp group {d} of {self.dp}")
        return list(range(d * self.sp, (d + 1) * self.sp))

    def sp_groups(self) -> list[list[int]]:
        return [self.sp_ranks(d) for d in range(self.dp)]

    def group_of(self, rank: int) -> int:
        """Which sp group (= which request slot of a wave) rank belongs to."""
        self._check_rank(rank)
        return rank // self.sp

    def sp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.sp

    def is_leader(self, rank: int) -> bool:
        """The first rank of its sp group: the one that returns the request's output."""
        return self.sp_rank(rank) == 0

    def leaders(self) -> list[int]:
        return [d * self.sp for d in range(self.dp)]

    def shard_group(self) -> list[int]:
        """Every rank of the node shares every block's weights: g = dp x sp."""
        return list(range(self.world))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} of {self.world}")


def check_layout(dp: int, sp: int, devices: int | None = None, heads: int | None = None,
                 kind: str = "ulysses") -> Layout:
    """The layout, or `LayoutError` with a one-line reason. `devices`: the node's accelerator count
    (None on cpu, where any dp x sp runs; with sp > 1 dp x sp must equal it, with sp = 1 not exceed
    it); `heads`: the transformer's attention heads (Ulysses
    splits them over the sp ranks)."""
    if dp < 1:
        raise LayoutError(f"--dp must be >= 1, got {dp}")
    if sp < 1:
        raise LayoutError(f"--sp must be >= 1, got {sp}")
    if kind not in SP_KINDS:
        raise LayoutError(f"--sp-kind must be one of {', '.join(SP_KINDS)}, got {kind!r}")
    # sp > 1 takes the whole node (dp x sp = devices); sp = 1 may use fewer devices than the node has
    # (a dp1 server on a two-device host, as before sequence parallelism existed), never more.
    if devices is not None and (dp * sp > devices or (sp > 1 and dp * sp != devices)):
        raise LayoutError(f"--dp {dp} x --sp {sp} = {dp * sp} ranks, but this node has {devices} devices: "
                          f"dp x sp must equal the device count")
    if sp > 1 and kind == "ulysses" and heads is not None and heads % sp:
        raise LayoutError(f"--sp {sp} (ulysses) splits the {heads} attention heads over the sp ranks: "
                          f"heads must be a multiple of sp")
    return Layout(dp, sp)


def check_tokens(width: int, height: int, size_multiple: int, sp: int) -> None:
    """`LayoutError` unless every latent frame's tokens split evenly over the sp ranks (a
    transformer token covers `size_multiple` x `size_multiple` pixels: VAE scale x patch)."""
    if sp <= 1:
        return
    per_frame = (width // size_multiple) * (height // size_multiple)
    if per_frame % sp:
        raise LayoutError(f"size {width}x{height} makes {per_frame} tokens per frame, which do not split over "
                          f"the {sp} sequence-parallel ranks of this server: (width/{size_multiple}) x "
                          f"(height/{size_multiple}) must be a multiple of {sp}")


def wave_assignments(requests: Sequence[T], layout: Layout) -> list[T | None]:
    """Per rank, the request it runs: request i on every rank of sp group i (same request, same
    seed), None (gather only) on the ranks of idle sp groups."""
    if not 1 <= len(requests) <= layout.dp:
        raise ValueError(f"a wave holds 1..{layout.dp} requests, got {len(requests)}")
    out: list[T | None] = []
    for d in range(layout.dp):
        out.extend([requests[d] if d < len(requests) else None] * layout.sp)
    return out


def leader_results(results: Sequence[T], layout: Layout, n: int) -> list[T]:
    """The results of a wave's n requests: the leader's of each busy sp group."""
    if len(results) != layout.world:
        raise ValueError(f"expected {layout.world} results, got {len(results)}")
    return [results[r] for r in layout.leaders()[:n]]


# ---- torch side ---------------------------------------------------------------------------------
@dataclass
class ParallelGroups:
    """This rank's groups: the shard group (None: the default group, all N ranks) and, for sp > 1,
    the device mesh (dims dp, ring, ulysses) and the process group of its sp group."""

    layout: Layout
    rank: int
    kind: SpKind = "ulysses"
    mesh: Any = None  # DeviceMesh (dp, ring, ulysses); None for sp = 1
    sp_group: Any = None  # ProcessGroup of this rank's sp group; None for sp = 1
    shard_group: Any = None  # None: the default group (every rank of the node); its own group when capped
    exchange: UlyssesExchange = "overlap"  # how Wan's Ulysses self-attention exchanges (ParallelSettings)

    @property
    def cp_mesh(self) -> Any:
        """The 2-D (ring, ulysses) mesh of this rank's sp group, as diffusers expects it."""
        return None if self.mesh is None else self.mesh["ring", "ulysses"]


def _weight_plane_group(world: int, device: Any, timeout: Any, cap: int | None) -> Any:
    """The shard group: None (the default group) unless the gathers' CTAs are capped, which NCCL
    takes per communicator: then a group of every rank with that config and the default group's
    `timeout` (else torch's 10 minutes would apply), its communicator made here (before any
    gather). Other backends have no such cap: the setting is logged and ignored."""
    import torch
    import torch.distributed as dist

    if cap is None:
        return None
    backend = dist.get_backend()
    if backend != "nccl" or world == 1:
        log.info("gather_max_ctas=%d ignored: %s", cap,
                 "one rank gathers nothing" if world == 1 else f"the {backend} backend has no CTA cap")
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = cap
    if timeout is not None:
        options._timeout = timeout
    group = dist.new_group(ranks=list(range(world)), timeout=timeout, pg_options=options)
    if device.index is not None:  # a bare "cuda" would put every rank's all-reduce on device 0
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    log.info("weight gathers run on their own communicator capped at %d CTAs (gather_max_ctas)", cap)
    return group


def make_groups(settings: ParallelSettings, device: Any, *, gathers: bool = True,
                timeout: Any = None) -> ParallelGroups:
    """Build this rank's groups; every rank of the default group calls it (the mesh's sub-groups
    are made collectively, in the same order everywhere). The default group must hold N ranks.
    `device`: this rank's device (or its type). For sp > 1 the sp group's communicator is made
    here with one tiny all-reduce, not lazily inside the first forward while weight gathers of the
    shard group are in flight. `gathers`: whether the weights are gathered (allgather mode): only
    then does `settings.gather_max_ctas` give the shard group a communicator of its own, with
    `timeout` (a timedelta: the default group's)."""
    import torch
    import torch.distributed as dist

    layout, kind = Layout(settings.dp, settings.sp), settings.sp_kind
    device = torch.device(device)
    device_type = device.type

    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise LayoutError(f"the process group has {world} ranks, the layout dp {layout.dp} x sp {layout.sp} "
                          f"needs {layout.world}")
    # every rank, in this order, before the mesh's groups
    shard_group = _weight_plane_group(world, device, timeout, settings.gather_max_ctas) if gathers else None
    if layout.sp == 1:
        return ParallelGroups(layout, rank, kind, shard_group=shard_group, exchange=settings.ulysses_exchange)
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.dp, 1, layout.sp) if kind == "ulysses" else (layout.dp, layout.sp, 1)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "ring", "ulysses"))
    sp_group = mesh["ulysses" if kind == "ulysses" else "ring"].get_group()
    got = sorted(dist.get_process_group_ranks(sp_group))
    assert got == layout.sp_ranks(layout.group_of(rank)), (got, rank, layout)
    if device.index is not None or device_type == "cpu":
        dist.all_reduce(torch.zeros(1, device=device), group=sp_group)
    return ParallelGroups(layout, rank, kind, mesh, sp_group, shard_group, settings.ulysses_exchange)


def context_parallel_config(groups: ParallelGroups) -> Any:
    """diffusers' `ContextParallelConfig` for this rank's sp group (Ulysses or ring)."""
    from diffusers import ContextParallelConfig

    sp = groups.layout.sp
    if groups.kind == "ulysses":
        return ContextParallelConfig(ulysses_degree=sp, mesh=groups.cp_mesh)
    return ContextParallelConfig(ring_degree=sp, mesh=groups.cp_mesh)


# module -> the process group of the sp ranks its context parallelism splits the sequence over
_SP_GROUPS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def sp_group_of(module: Any) -> Any:
    """The sp group `enable_sequence_parallel` split `module`'s sequence over; None without sp."""
    return _SP_GROUPS.get(module)


def enable_sequence_parallel(module: Any, groups: ParallelGroups, device: Any, *,
                             exchange: UlyssesExchange | None = None) -> bool:
    """Turn on diffusers' context parallelism on `module` over this rank's sp group (no-op for
    sp = 1); True if it did. Ring attention needs a backend that returns the log-sum-exp (the
    native one does not): on cuda it runs through `_native_cudnn`. `exchange` (default: the groups'
    `ParallelSettings.ulysses_exchange`, `overlap`): with Ulysses, `overlap` or `lean` route Wan's
    self-attention through `dlo.engine.ulysses` (the same bytes as diffusers' path, fewer copies, the
    exchanges beside compute: record `h200x2-sp-2026-12-01-lean`); `diffusers` keeps diffusers'."""
    import torch

    if groups.layout.sp == 1:
        return False
    exchange = groups.exchange if exchange is None else exchange
    if exchange not in ULYSSES_EXCHANGES:
        raise LayoutError(f"exchange must be one of {', '.join(ULYSSES_EXCHANGES)}, got {exchange!r}")
    device = torch.device(device)
    if groups.kind == "ring":
        if device.type != "cuda":
            raise LayoutError("--sp-kind ring needs cuda (diffusers' ring attention needs an attention backend "
                              "that returns the log-sum-exp); use --sp-kind ulysses")
        module.set_attention_backend("_native_cudnn")
    with _accelerator_count_for(device):
        module.enable_parallelism(config=context_parallel_config(groups))
    _SP_GROUPS[module] = groups.sp_group
    if exchange != "diffusers":
        from dlo.engine.ulysses import use_dlo_ulysses

        n = (use_dlo_ulysses(module, groups.sp_group, groups.layout.sp, overlap=exchange == "overlap")
             if groups.kind == "ulysses" else 0)
        if n:
            log.info("sp: %d Wan attention processors exchange through DLO's Ulysses (DLO_ULYSSES=%s)", n, exchange)
        else:  # the default applying to nothing is the normal case for other families: not worth a line
            log.log(logging.DEBUG if exchange == ULYSSES_EXCHANGES[0] else logging.INFO,
                    "sp: ulysses_exchange=%s ignored: it applies to Wan's self-attention with --sp-kind ulysses "
                    "(here: %s, sp-kind %s)", exchange, type(module).__name__, groups.kind)
    return True


@contextlib.contextmanager
def _accelerator_count_for(device: Any):
    """diffusers 0.42 derives the context-parallel device as `rank % torch.accelerator.device_count()`,
    a division by zero on a host without an accelerator. On cpu the count is 1 for that call (the
    device it derives is then `cpu`, which is what the gloo ranks compute on); elsewhere untouched."""
    import torch

    if device.type != "cpu" or torch.accelerator.device_count() > 0:
        yield
        return
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.device_count = real  # type: ignore[assignment]
