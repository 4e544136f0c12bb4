"""`dlo serve`'s configuration: one frozen object built once from the flags and passed down.

Owns: `ServeConfig` and its groups, named as `dlo serve --help` groups its flags: `ApiConfig`
(model name, address, keys and tenants, queue, connections), `RequestLimits` (the limits file and
the flags over it, the warm-up, video jobs), `LayoutConfig` (device, dp x sp, mode, profile),
`MemoryConfig` (the device budget and how weights are placed and streamed), `TuningConfig` (measured defaults a
benchmark may change); the LoRA flags are `dlo.engine.settings.LoraSettings` itself. Built by
`dlo.serving.options.serve_config`, the one reader of the argparse Namespace; `engine_settings`
turns it and the deployment plan into the settings every rank starts with.
Must never: read the environment or the file system (the options module resolves paths; the start
steps read files), or hold what the start decides (the plan, the limits read: `dlo.serving.serve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping

from dlo.engine.settings import (
    EngineSettings,
    LoraSettings,
    OffloadSettings,
    ParallelSettings,
    StreamDtype,
    Transfer,
    UlyssesExchange,
    Weights,
    from_environment,
    split_overrides,
)
from dlo.cli.logs import LogFormat
from dlo.engine.cache_presets import CacheSpec
from dlo.plan.facts import DeviceKind, ModeOrAuto

if TYPE_CHECKING:  # the plan's module imports pydantic: only where a plan is made
    from dlo.plan.deployment import DeploymentPlan, PlanAsk

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP API: where it listens, who may call it, how much it queues and holds open."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key_file: Path | None = None
    api_keys: Path | None = None  # named keys, one tenant each (dlo.serving.api_keys)
    admin_keys: tuple[str, ...] = ()  # names of --api-keys that see every tenant's video jobs
    max_queue: int = 64
    max_queue_per_tenant: int | None = None  # None: --max-queue alone
    wave_window_ms: float = 5.0
    progress_timeout: float = 300.0
    shutdown_grace: float = 25.0
    max_connections: int | None = None
    idle_timeout: float = 10.0
    body_timeout: float = 10.0
    min_body_rate: int = 4096
    probe_cidr: tuple[IPv4Network | IPv6Network, ...] = ()
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"  # `--log-format`: text lines, or JSON lines (dlo.cli.logs)


@dataclass(frozen=True)
class RequestLimits:
    """What requests may ask (the limits file and the flags over it), the warm-up, video jobs."""

    limits: Path | None = None
    small_limits: bool = False
    max_steps: int | None = None
    max_size: int | None = None
    warmup: bool = True
    warmup_size: str | None = None
    warmup_steps: int = 1
    startup_timeout: float = 900.0
    video_dir: Path | None = None
    video_ttl: float = 3600.0
    max_video_jobs_per_tenant: int = 64


@dataclass(frozen=True)
class LayoutConfig:
    """Device, ranks and mode as asked (`dp` None: one per device)."""

    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    dp: int | None = None
    sp: int = 1
    sp_kind: Literal["ulysses", "ring"] = "ulysses"
    mode: ModeOrAuto = "auto"
    profile: Path | None = None


@dataclass(frozen=True)
class MemoryConfig:
    """The device budget and how the weights are placed and streamed."""

    max_device_memory: int = 0  # bytes per rank; 0: the device's memory
    resident_blocks: int | Literal["auto"] | None = None  # None: auto on an accelerator, 0 on cpu
    stream_dtype: StreamDtype = "bfloat16"
    stream_text_encoders: bool = True
    cfg_pairs: bool = True
    vae_tiling: Literal["auto", "always", "never"] = "auto"
    peaks_deadline: float = 300.0  # seconds a first start may measure decode peaks (0: never)
    weights: Weights = "auto"
    cpu_threads: int = 1
    safety_checker: bool = False

    def resident_blocks_on(self, device: DeviceKind) -> int | Literal["auto"]:
        """`--resident-blocks` as given, else auto on an accelerator and none on cpu."""
        if self.resident_blocks is not None:
            return self.resident_blocks
        return "auto" if device != "cpu" else 0


@dataclass(frozen=True)
class TuningConfig:
    """Measured defaults; a flag set here wins over its `DLO_*` variable (None: not set)."""

    gather: Transfer | None = None
    gather_max_ctas: int | None = None
    ulysses_exchange: UlyssesExchange | None = None
    register_early: bool | None = None


@dataclass(frozen=True)
class ServeConfig:
    """Every `dlo serve` flag, typed and grouped; `model` is a folder once a URI has been fetched."""

    model: Path | str
    api: ApiConfig = field(default_factory=ApiConfig)
    requests: RequestLimits = field(default_factory=RequestLimits)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    cache: CacheSpec | None = None  # `--cache`: the step cache of a request that names none

    @property
    def model_dir(self) -> Path:
        if not isinstance(self.model, Path):
            raise TypeError(f"the model {self.model!r} is a URI not fetched yet")
        return self.model

    @property
    def cfg_pairs_asked(self) -> bool:
        """`--cfg-pairs` where they may run at all (sp 1): what the plan counts before any rank loads;
        the family, mode and device decide the rest (`dlo.engine.cfg_pairs.pairing_on`)."""
        return self.memory.cfg_pairs and self.layout.sp == 1

    def plan_ask(self, device: DeviceKind, dp: int, adapter_bytes: int = 0, merges_bytes: int = 0) -> PlanAsk:
        """What this configuration asks of the deployment plan on `device` with `dp` ranks."""
        from dlo.plan.deployment import LoraAsk, PlanAsk

        lora = self.lora
        return PlanAsk(
            dp=dp, sp=self.layout.sp, mode=self.layout.mode, device=device,
            max_device_memory=self.memory.max_device_memory,
            resident_blocks=self.memory.resident_blocks_on(device), stream_dtype=self.memory.stream_dtype,
            stream_encoders=self.memory.stream_text_encoders, cfg_pairs=self.memory.cfg_pairs,
            vae_tiling=self.memory.vae_tiling,
            lora=LoraAsk(adapter_bytes=adapter_bytes, merges_bytes=merges_bytes, apply=lora.apply,
                         merge_cache=lora.merge_cache_bytes, merge_above_tokens=lora.merge_above_tokens,
                         served=lora.directory is not None))


def engine_settings(cfg: ServeConfig, plan: DeploymentPlan, environ: Mapping[str, str]) -> EngineSettings:
    """The engine's settings from the configuration and the deployment plan (mode, dp, device, the
    resident blocks, the decode rule and an auto merge cache decided), the `DLO_*` variables where a
    tuning flag is unset, and the defaults; `ConfigError` naming the setting when they describe no engine."""
    tuning = {"transfer": cfg.tuning.gather, "gather_max_ctas": cfg.tuning.gather_max_ctas,
              "ulysses_exchange": cfg.tuning.ulysses_exchange, "register_early": cfg.tuning.register_early}
    chosen = {**from_environment(environ), **{k: v for k, v in tuning.items() if v is not None}}
    offload, parallel = split_overrides(chosen)
    mem, lora = cfg.memory, cfg.lora
    if plan.lora_merge_cache_bytes is not None:
        lora = replace(lora, merge_cache_bytes=plan.lora_merge_cache_bytes)
    if plan.lora_merge_above_tokens is not None:
        lora = replace(lora, merge_above_tokens=plan.lora_merge_above_tokens)
    return EngineSettings(
        offload=OffloadSettings(mode=plan.mode, resident_blocks=mem.resident_blocks_on(plan.device),
                                weights=mem.weights, stream_dtype=mem.stream_dtype, **offload),
        parallel=ParallelSettings(dp=plan.dp, sp=plan.sp, sp_kind=cfg.layout.sp_kind, **parallel),
        device=plan.device, max_device_memory=mem.max_device_memory,
        stream_encoders=mem.stream_text_encoders, cpu_threads=mem.cpu_threads, safety_checker=mem.safety_checker,
        lora=lora, cfg_pairs=mem.cfg_pairs, resident_plan=plan.resident, cache=cfg.cache,
        vae_tile_above_pixels=plan.vae_tile_above_pixels,
    )
