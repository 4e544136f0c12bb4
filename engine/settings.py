"""Every engine switch as one typed, validated object: what `dlo serve` builds and passes down whole.

Owns: `OffloadSettings` (how `dlo.engine.load` places and streams one model's weights),
`ParallelSettings` (dp x sp and how the ranks exchange), `ResidentPlan` (`--resident-blocks auto` as
`dlo serve` resolved it), `LoraSettings` (the per-request LoRA adapters and when they load),
`EngineSettings` (all of them, plus what a rank's device and pipeline are
started with, and the step cache a request that names none runs with), `ConfigError` (the one error a bad setting raises; `dlo serve`
prints it in one line and exits 2), and `from_environment`: the one reader of the engine's `DLO_*`
switches (vLLM's `envs.py` pattern), called only by `dlo serve` and the benchmarks, so that the
variables keep working beside the flags named after them.
Must never: import torch, read the environment anywhere but `from_environment`, or hold process
plumbing (a rank's number, ports, the control key: `serving/rank_main.py` reads those).

Settings are frozen and checked in `__post_init__`: an object that exists is valid, and a rank
receives exactly what rank 0 validated (`EngineSettings.to_dict` / `from_dict` inside `RankConfig`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Literal, Mapping, get_args

from dlo.engine.cache_presets import (  # the presets reach the operator through the settings
    FACTORS_DTYPES, PRESETS, CacheSpec, CacheSpecError, cache_dict, cache_spec)
from dlo.plan.errors import ConfigError, flag as _flag, one_of as _one_of, whole as _whole
from dlo.plan.facts import MODES, DeviceKind, Mode
from dlo.plan.resident import VAE_TILE_ABOVE_PIXELS, ResidentPlan

Weights = Literal["auto", "arena", "registered"]
WEIGHTS: tuple[Weights, ...] = get_args(Weights)
# How allgather mode rebuilds a block: the platform's in-place AllGather, or peer copies
# (dlo.engine.peergather: each rank pulls the others' shards with the copy engines).
Transfer = Literal["collective", "peer"]
TRANSFERS: tuple[Transfer, ...] = get_args(Transfer)
# How Wan's Ulysses self-attention exchanges (dlo.engine.ulysses); the default first.
UlyssesExchange = Literal["overlap", "lean", "diffusers"]
ULYSSES_EXCHANGES: tuple[UlyssesExchange, ...] = get_args(UlyssesExchange)
# The dtype streamed blocks' linear weights are held in on the host and copied as: fp8 is float8
# e4m3 with a scale per output channel, dequantized into bfloat16 on the device (dlo.engine.fp8).
StreamDtype = Literal["bfloat16", "fp8"]
STREAM_DTYPES: tuple[StreamDtype, ...] = get_args(StreamDtype)
SpKind = Literal["ulysses", "ring"]
SP_KINDS: tuple[SpKind, ...] = get_args(SpKind)
DEVICES: tuple[DeviceKind, ...] = get_args(DeviceKind)
MAX_GATHER_CTAS = 64


@dataclass(frozen=True)
class OffloadSettings:
    """How one model's weights are placed and streamed (`dlo.engine.load(settings=...)`)."""

    mode: Mode
    # blocks kept on the device, spread through the order; "auto": as many as the device allows
    resident_blocks: int | Literal["auto"] = 0
    weights: Weights = "auto"  # host source of block bytes (docs/contracts.md section 3)
    transfer: Transfer = "collective"  # allgather over > 1 rank: AllGather, or peer copies
    transfer_graphs: bool | None = None  # each block's transfer replayed as CUDA graphs; None: on cuda
    time_waits: bool = True  # time the compute stream's waits for weights (event pairs)
    register_early: bool = True  # register the page cache on a thread while the model is built
    stream_dtype: StreamDtype = "bfloat16"  # how streamed blocks are held and copied

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, MODES)
        if self.resident_blocks != "auto":
            try:
                _whole("resident_blocks", self.resident_blocks, 0)
            except ConfigError:
                raise ConfigError(f"resident_blocks must be 'auto' or an integer >= 0, got {self.resident_blocks!r}") from None
        _one_of("weights", self.weights, WEIGHTS)
        _one_of("transfer", self.transfer, TRANSFERS)
        _flag("transfer_graphs", self.transfer_graphs, optional=True)
        _flag("time_waits", self.time_waits)
        _flag("register_early", self.register_early)
        _one_of("stream_dtype", self.stream_dtype, STREAM_DTYPES)

    def but(self, **changes: Any) -> "OffloadSettings":
        """A copy with `changes` (validated like any other)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class ParallelSettings:
    """dp x sp ranks on a node, and how they exchange (`dlo.engine.parallel.make_groups`)."""

    dp: int = 1  # requests per wave
    sp: int = 1  # ranks per request (sequence parallel)
    sp_kind: SpKind = "ulysses"
    ulysses_exchange: UlyssesExchange = "overlap"
    gather_max_ctas: int | None = None  # the weight gathers on their own NCCL communicator, capped

    def __post_init__(self) -> None:
        _whole("dp", self.dp, 1)
        _whole("sp", self.sp, 1)
        _one_of("sp_kind", self.sp_kind, SP_KINDS)
        _one_of("ulysses_exchange", self.ulysses_exchange, ULYSSES_EXCHANGES)
        if self.gather_max_ctas is not None:
            _whole("gather_max_ctas", self.gather_max_ctas, 1, MAX_GATHER_CTAS)

    @property
    def world(self) -> int:
        """Rank processes on the node: dp sp groups of sp ranks each."""
        return self.dp * self.sp


# When adapters reach a rank's device. Only "start": every adapter of the folder on every rank
# before /ready (device bytes: the sum of the adapters, in the model's dtype). A load on first use
# would run inside a wave, where in allgather mode the ranks sharing the weights wait for the slowest
# (the whole wave stalls for one rank's file read and copy), so it is not offered.
LoraLoad = Literal["start"]
LORA_LOADS: tuple[LoraLoad, ...] = get_args(LoraLoad)

# How a request's adapter reaches a targeted layer's output (`dlo.engine.lora`): "branch" adds the
# unmerged low-rank branch to the layer's output (peft's forward: equals diffusers + load_lora_weights
# bit for bit); "merge" computes the layer with W + scaling * B A, merged per call into a device
# scratch of the rank's own (peft's merge: equals diffusers + load_lora_weights + fuse_lora bit for
# bit), never into the weight or the slot. The merge costs a pass over the weight where the branch
# costs passes over the layer's input and output: cheaper where tokens outnumber a layer's width.
# "auto" (the default) merges for a request whose transformer calls hold more than
# `merge_above_tokens` tokens, else adds the branch: decided per request from its shape and the
# deployment's flags alone, so a request's bytes are the same in every mode, dp and sp. Measured on
# one H200 (Wan2.1-14B, a rank-64 adapter, per block, `bench/results/lora-h200-2026-12-02.md`): merge
# over branch 1.053 at 4,096 tokens, 0.998 at 7,800, 0.974 at 32,760; Flux.1-dev 1.072 at 4,096.
# With a merge cache (`merge_cache_bytes`: "auto", the default, is what the device budget has spare
# once `dlo serve` has planned the mode; none on cpu) a resident layer's merge is made once per
# adapter and scale, so auto merges every call there (`merge_above_tokens` None resolves to 0: a
# cached adapter costs what the base model costs, 0.997-1.002x end to end measured); without one,
# above LORA_MERGE_ABOVE_TOKENS. The choice depends on the flags and the device kind, never on how
# much the cache got, so it is the same in every mode.
LoraApply = Literal["auto", "branch", "merge"]
LORA_APPLIES: tuple[LoraApply, ...] = get_args(LoraApply)
LORA_MERGE_ABOVE_TOKENS = 8000  # `--lora-merge-above` without a merge cache: the measured crossover, above Wan2.1's 7,800
LoraMergeCache = int | Literal["auto"]
# `--lora-merge-kernel`: "triton" (default) merges in one pass on cuda where Triton runs and the kernel
# gives the two steps' bytes (`dlo.engine.lora.merge_kernel`; measured bit-identical on every Wan2.1 and
# Flux.1-dev shape, 0.56 ms a Wan2.1 block against 1.03: record `raw-lora-merge-kernel-2026-12-06`); "torch": peft's two
# steps as two torch ops (where the kernel cannot run or differs, "triton" gives these too)
LoraMergeKernel = Literal["torch", "triton"]
LORA_MERGE_KERNELS: tuple[LoraMergeKernel, ...] = get_args(LoraMergeKernel)


@dataclass(frozen=True)
class LoraSettings:
    """Per-request LoRA adapters (`dlo.engine.lora`): the folder of adapters, when they load, how they apply."""

    directory: str | None = None  # `dlo serve --lora-dir`; None: no adapters
    load: LoraLoad = "start"
    apply: LoraApply = "auto"  # `dlo serve --lora-apply`
    # `--lora-merge-cache`: device bytes of resident layers' merges kept (merge, auto); "auto": what the
    # budget has spare, sized by `dlo serve`'s plan (`dlo.plan.deployment.auto_merge_cache`), none
    # where nothing sized it (cpu)
    merge_cache_bytes: LoraMergeCache = "auto"
    # `--lora-merge-above`: auto merges calls of more tokens; None: 0 with a merge cache, else
    # LORA_MERGE_ABOVE_TOKENS (`merge_above`)
    merge_above_tokens: int | None = None
    merge_kernel: LoraMergeKernel = "triton"  # `--lora-merge-kernel`

    def __post_init__(self) -> None:
        if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
            raise ConfigError(f"lora directory must be a folder path or unset, got {self.directory!r}")
        _one_of("lora load", self.load, LORA_LOADS)
        _one_of("lora apply", self.apply, LORA_APPLIES)
        if self.merge_cache_bytes != "auto":
            _whole("lora merge_cache_bytes", self.merge_cache_bytes, 0)
        if self.merge_above_tokens is not None:
            _whole("lora merge_above_tokens", self.merge_above_tokens, 0)
        _one_of("lora merge_kernel", self.merge_kernel, LORA_MERGE_KERNELS)
        if self.cache_capacity and self.apply == "branch":
            raise ConfigError("lora merge_cache_bytes (--lora-merge-cache) keeps merged weights: it needs lora apply "
                              "'merge' or 'auto' (--lora-apply), not 'branch'")

    @property
    def cache_capacity(self) -> int:
        """Device bytes the merge cache may keep (an unsized "auto": none)."""
        return 0 if self.merge_cache_bytes == "auto" else self.merge_cache_bytes

    @property
    def merge_above(self) -> int:
        """Tokens per transformer call above which a request's adapter is merged; -1: always (merge),
        and for branch never (no scratch is made)."""
        if self.apply == "merge":
            return -1
        if self.merge_above_tokens is not None:
            return self.merge_above_tokens
        return 0 if self.cache_capacity else LORA_MERGE_ABOVE_TOKENS


@dataclass(frozen=True)
class EngineSettings:
    """What every rank of an engine is started with, carried whole from `dlo serve` to the prefetcher."""

    offload: OffloadSettings
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    device: DeviceKind = "cpu"
    # The device budget per rank (0: the device's memory): the allocator's cap, and what the mode
    # policy and the memory model plan with (`dlo.plan.budget`); one number for both, so
    # that a plan never assumes memory the allocator may not take, nor a cap go unplanned.
    max_device_memory: int = 0
    # the family's large text encoders stream like the transformers (offloaded modes only)
    stream_encoders: bool = False
    cpu_threads: int = 1  # intra-op threads per cpu rank (fixed: results do not depend on dp)
    lora: LoraSettings = field(default_factory=LoraSettings)
    # `--resident-blocks auto` resolved for the deployment (None: no budget known, e.g. cpu: none kept)
    resident_plan: ResidentPlan | None = None
    # decoded pixels above which the VAE tiles (0: every decode): one rule for every rank and mode
    vae_tile_above_pixels: int = VAE_TILE_ABOVE_PIXELS
    # the pipeline's own safety checker where it has one (Cosmos3's cosmos_guardrail, which needs its
    # package and models in the image); off by default
    safety_checker: bool = False
    # `--cfg-pairs`: a step's cond and uncond calls walk the streamed blocks together (one gather a
    # block a step; `dlo.engine.cfg_pairs`); where the deployment cannot pair, unpaired (logged).
    # On: the same bytes; Wan2.1-14B's request 0.7-1.0% faster and a rank-64 LoRA's cost 1.036x to
    # 1.021x, Qwen-Image-20B streamed under a 24 GiB cap 16.07 s to 9.67 s (records `lora-h200-2026-12-06-pairs`,
    # `raw-small-gpu-h200-2026-12-06-qwen-pairs`)
    cfg_pairs: bool = True
    # `--cache`: the step cache of a request that names none (`dlo.engine.cache_presets`); None: none
    cache: CacheSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.offload, OffloadSettings) or not isinstance(self.parallel, ParallelSettings):
            raise ConfigError("offload and parallel must be OffloadSettings and ParallelSettings")
        if not isinstance(self.lora, LoraSettings):
            raise ConfigError("lora must be LoraSettings")
        _one_of("device", self.device, DEVICES)
        _whole("max_device_memory", self.max_device_memory, 0)
        if self.max_device_memory and self.device == "cpu":
            raise ConfigError("max_device_memory needs a cuda or npu device; the device is cpu")
        _flag("stream_encoders", self.stream_encoders)
        _whole("cpu_threads", self.cpu_threads, 1)
        _whole("vae_tile_above_pixels", self.vae_tile_above_pixels, 0)
        if self.resident_plan is not None and not isinstance(self.resident_plan, ResidentPlan):
            raise ConfigError("resident_plan must be a ResidentPlan")
        _flag("safety_checker", self.safety_checker)
        _flag("cfg_pairs", self.cfg_pairs)
        if self.cache is not None and not isinstance(self.cache, tuple(PRESETS.values())):
            raise ConfigError(f"cache must be a step cache preset or unset, got {self.cache!r}")

    @property
    def mode(self) -> Mode:
        return self.offload.mode

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (the form `RankConfig` carries to the child ranks)."""
        return {**asdict(self), "cache": cache_dict(self.cache)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineSettings":
        """The inverse of `to_dict`; unknown keys are an error (a rank started by another version)."""
        data = dict(data)
        try:
            offload = OffloadSettings(**data.pop("offload"))
            parallel = ParallelSettings(**data.pop("parallel", {}))
            lora = LoraSettings(**data.pop("lora", {}))
            plan = data.pop("resident_plan", None)
            return cls(offload=offload, parallel=parallel, lora=lora, cache=cache_spec(data.pop("cache", None)),
                       resident_plan=ResidentPlan(**plan) if plan else None, **data)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"engine settings do not parse: {e}") from None


# ---- the environment (compatibility: each variable has a `dlo serve` flag named after it) -------
def _choice(allowed: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        if raw not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {raw!r}")
        return raw

    return parse


def _ctas(name: str, raw: str) -> int:
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_GATHER_CTAS:
        raise ConfigError(f"{name} must be an integer from 1 to {MAX_GATHER_CTAS} (CTAs per weight gather), "
                          f"got {raw!r}")
    return int(raw)


def _zero_or_one(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


@dataclass(frozen=True)
class EnvVar:
    """One `DLO_*` switch: the setting it gives a value to and the `dlo serve` flag that overrides it."""

    setting: str  # a field of OffloadSettings or ParallelSettings
    flag: str
    parse: Callable[[str, str], Any]


# The engine's switches by variable. Empty means unset (a template's default).
ENVIRONMENT: dict[str, EnvVar] = {
    "DLO_GATHER": EnvVar("transfer", "--gather", _choice(TRANSFERS)),
    "DLO_GATHER_MAX_CTAS": EnvVar("gather_max_ctas", "--gather-max-ctas", _ctas),
    "DLO_ULYSSES": EnvVar("ulysses_exchange", "--ulysses-exchange", _choice(ULYSSES_EXCHANGES)),
    "DLO_REGISTER_EARLY": EnvVar("register_early", "--register-early", _zero_or_one),
}


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings the `DLO_*` variables of `environ` set, by setting name (only those set);
    a bad value raises `ConfigError` naming the variable. The caller passes `os.environ`."""
    out: dict[str, Any] = {}
    for name, var in ENVIRONMENT.items():
        raw = environ.get(name, "").strip()
        if raw:
            out[var.setting] = var.parse(name, raw)
    return out


def split_overrides(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Setting values by name -> (those of OffloadSettings, those of ParallelSettings)."""
    offload_names = {f.name for f in fields(OffloadSettings)}
    parallel_names = {f.name for f in fields(ParallelSettings)}
    unknown = set(values) - offload_names - parallel_names
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    return ({k: v for k, v in values.items() if k in offload_names},
            {k: v for k, v in values.items() if k in parallel_names})
