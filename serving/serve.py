"""Serve a diffusers pipeline folder over an OpenAI-compatible HTTP API, on dp ranks.

`dlo serve MODEL_DIR` starts rank 0 (this process: HTTP, wave scheduler, and a compute rank) and
spawns ranks 1..dp-1. The transformer runs through the DLO engine in the chosen mode; text
encoders and the VAE load normally on every rank. See docs/serving.md for the API.

Owns: the `dlo serve` start in named steps (`main`): everything a flag, the folder, the key or the
port can get wrong is refused in one line with exit 2 before any rank starts (`StartError`);
the deployment plan asked of `dlo.plan` (`_plan`); and wiring the service, the rank group and the
HTTP server together. Every step reads the one `ServeConfig` (`dlo.serving.options.serve_config`).
Must never: import `dlo.agent`, take a secret from the command line, or start a rank before the
listening port is ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

from dlo.cli.logs import configure_logging, say
from dlo.cli.tracing import TracingError, flush as flush_traces, start_tracing
from dlo.engine.settings import ConfigError, from_environment
from dlo.engine.timing import Laps, start_laps
from dlo.plan.deployment import DeploymentPlan
from dlo.plan.facts import DeviceKind

from dlo.serving.api_keys import read_api_key  # the one-key reader (re-exported)
from dlo.serving.config import ServeConfig, engine_settings
from dlo.serving.options import add_arguments, serve_config
from dlo.serving.start_peaks import start_measure

__all__ = ["add_arguments", "main", "engine_settings", "read_api_key", "StartError"]


class StartError(Exception):
    """A reason `dlo serve` cannot start: printed as one line, exit 2, before any rank starts."""


def _warmup_size(flag: str | None, facts: Any, limits: Any) -> tuple[int, int] | None:
    """The warm-up's size: `--warmup-size WxH` (an invalid one is an error: `ApiError`), `smallest`
    (None), or by default what a request without `size` gets: the limits' default clamped to them
    (`default_video_size` for a model of videos only, whose warm-up is a video)."""
    from dlo.serving.api_models import parse_size
    from dlo.serving.served_limits import default_size

    if flag == "smallest":
        return None
    if flag:
        return parse_size(flag, facts, limits)
    return default_size(facts, limits, video=not facts.images)


def _check_adapters(lora_dir: Path, model_dir: Path, facts: Any, sp: int) -> list[Any]:
    """`--lora-dir`'s adapters checked against the transformer before any rank starts (an
    `AdapterError` names the file): their plans (`dlo.engine.lora.AdapterPlan`)."""
    from dlo.engine.lora import AdapterError, check_adapters

    plans = check_adapters(lora_dir, model_dir, facts.pipeline_class)
    if sp > 1 and plans:  # diffusers' context parallelism gathers these outputs inside their forward
        import diffusers

        cp_plan = getattr(getattr(diffusers, facts.transformer_class, None), "_cp_plan", None) or {}
        gathered = {k for k, v in cp_plan.items() if type(v).__name__ == "ContextParallelOutput"}
        for plan in plans:
            for m in plan.modules:
                if m.module in gathered:
                    raise AdapterError(plan.path, f"targets {m.module}, whose output sequence parallelism gathers "
                                                  "across the sp ranks before a hook could add the branch; serve "
                                                  "it with --sp 1")
    if not plans:
        log.warning("--lora-dir %s holds no adapters (NAME.safetensors files or NAME/ folders)", lora_dir)
    for plan in plans:
        log.info("lora adapter %s: %s modules, %d device bytes per rank", plan.name, len(plan.modules),
                 plan.device_bytes)
    return plans


def _adapters(cfg: ServeConfig, start: "_Start") -> None:
    """The adapters checked, what every rank holds for them (the plan's)."""
    from dlo.engine.lora import all_merges_bytes, rank_device_bytes

    lora = cfg.lora
    if lora.directory is None:
        return
    lora_dir = Path(lora.directory)  # resolved
    plans = _check_adapters(lora_dir, start.model_dir, start.facts, cfg.layout.sp)
    start.adapters = {plan.name: plan.path.relative_to(lora_dir).parts[0] for plan in plans}
    # with CFG pairs a streamed block's merges are kept for the second lane (counted wherever they may run)
    kept = start.facts.adapter.blocks.block_lists if cfg.cfg_pairs_asked and start.facts.adapter.cfg_pairs else ()
    start.adapter_bytes = rank_device_bytes(plans, lora.apply, lora.cache_capacity, kept)  # an auto cache: sized later
    start.adapter_merges_bytes = all_merges_bytes(plans) if lora.apply != "branch" else 0


def _attention_heads(model_dir: Path) -> int | None:
    """The transformer's attention heads (Ulysses splits them over the sp ranks), if its config says."""
    from dlo.engine.checkpoint import CheckpointError, read_json_config

    try:
        heads = read_json_config(model_dir / "transformer" / "config.json").get("num_attention_heads")
    except CheckpointError:
        return None
    return heads if isinstance(heads, int) else None


@dataclass
class _Start:
    """What the checks before any rank decided, step by step."""

    model_dir: Path
    laps: Laps  # from the process's start: the interpreter and this module's imports, then each step
    facts: Any = None
    limits: Any = None
    warmup_size: tuple[int, int] | None = None
    tenants: Any = None  # who may call (`dlo.serving.tenants.Tenants`)
    device: DeviceKind = "cpu"
    dp: int = 1
    listener: socket.socket | None = None
    videos: Any = None
    peers: Any = None
    plan: DeploymentPlan | None = None  # what the deployment runs (dlo.plan.deployment.plan)
    adapters: dict[str, str] = field(default_factory=dict)  # --lora-dir: name -> file or folder
    adapter_bytes: int = 0  # what every rank holds for them (`dlo.engine.lora.rank_device_bytes`)
    adapter_merges_bytes: int = 0  # the most a merge cache could hold (an auto cache's cap)


def _model_and_limits(cfg: ServeConfig, start: _Start) -> None:
    """The folder (headers, index and shards, torch-free: most broken checkpoints are refused here;
    dtypes and shapes are checked when each rank loads; the parse is cached for the policy and rank
    0), the limits, the warm-up size; a cold folder's readahead starts here."""
    from dlo.engine.checkpoint import CheckpointError, cached_checkpoint
    from dlo.engine.families import pipeline_facts
    from dlo.engine.lora import AdapterError
    from dlo.serving.api_models import ApiError
    from dlo.serving.prewarm import start_early_readahead
    from dlo.serving.served_limits import load_limits

    try:
        start.facts = pipeline_facts(start.model_dir)
        cached_checkpoint(start.model_dir / "transformer")
        # a cold folder's reads start here, before torch is imported (rank 0's load adopts them)
        encoders = start.facts.adapter.streamable_encoders if cfg.memory.stream_text_encoders else ()
        start_early_readahead(start.model_dir, (*start.facts.transformers, *encoders))
        req = cfg.requests
        start.limits = load_limits(req.limits, req.small_limits, req.max_steps, req.max_size, start.facts)
        start.warmup_size = _warmup_size(req.warmup_size, start.facts, start.limits)
        _adapters(cfg, start)
    except AdapterError as e:
        raise StartError(f"--lora-dir: refusing an adapter that does not fit the model: {e}") from None
    except ApiError as e:
        raise StartError(f"--warmup-size: {e.message}") from None
    except CheckpointError as e:
        raise StartError(f"refusing a broken checkpoint: CheckpointError: {e}") from None
    except (ValueError, OSError) as e:  # the limits file, the LoRA flags disagreeing (ConfigError)
        raise StartError(str(e)) from None


def _layout(cfg: ServeConfig, start: _Start) -> None:
    """Device, dp x sp, and the flags that depend on them; the `DLO_*` switches."""
    from dlo.serving.distmap import start_distribution_map

    start_distribution_map()  # once the folder passed its checks; beside torch's import below (distmap.py)
    from dlo.engine.devices import resolve_device, visible_devices
    from dlo.engine.parallel import LayoutError, check_layout, check_tokens

    layout, api = cfg.layout, cfg.api
    start.device = device = resolve_device(layout.device)
    sp = layout.sp
    try:
        # none visible: one line, not a count
        devices = visible_devices(device, os.environ) if device != "cpu" else None
        start.dp = layout.dp or max(1, (devices or 1) // max(1, sp))
        check_layout(start.dp, sp, devices, _attention_heads(start.model_dir), layout.sp_kind)
        if sp > 1 and start.facts.no_sp:
            raise LayoutError(f"--sp {sp}: the {start.facts.family} family runs without sequence parallelism: "
                              f"{start.facts.no_sp}")
        if sp > 1 and layout.sp_kind == "ring" and device != "cuda":
            raise LayoutError("--sp-kind ring needs cuda (diffusers' ring attention needs an attention backend "
                              "that returns the log-sum-exp); use --sp-kind ulysses")
        if start.warmup_size is not None:
            check_tokens(*start.warmup_size, start.facts.size_multiple, sp)
        from_environment(os.environ)  # the DLO_* switches: a bad one is refused before anything loads
    except ConfigError as e:
        raise StartError(str(e)) from None
    if api.shutdown_grace < 0:
        raise StartError("--shutdown-grace must be >= 0")
    if (api.max_connections is not None and api.max_connections < 1) or api.idle_timeout <= 0:
        raise StartError("--max-connections must be >= 1 and --idle-timeout > 0")
    if cfg.memory.max_device_memory and device not in ("cuda", "npu"):
        raise StartError(f"--max-device-memory needs a cuda or npu device; --device resolved to {device}")


def _library_warmup(cfg: ServeConfig, start: _Start) -> None:
    """On cuda, rank 0's (this process's) device libraries load beside the steps after this one."""
    if start.device == "cuda":
        from dlo.serving.prewarm import start_early_library_warmup

        start_early_library_warmup("cuda:0")


def _video_store(cfg: ServeConfig, start: _Start) -> None:
    """Video jobs: the store names this pod in its ids; peers answer for the other pods' jobs."""
    from dlo.serving.peers import Peers
    from dlo.serving.videos import VideoStore, default_video_dir

    try:
        req = cfg.requests
        start.videos = VideoStore(req.video_dir or default_video_dir(cfg.api.port), ttl_s=req.video_ttl,
                                  pod=os.environ.get("DLO_POD_NAME") or None,
                                  max_jobs_per_client=req.max_video_jobs_per_tenant)
        start.videos.load()
        start.peers = Peers.from_env()
    except (ValueError, OSError) as e:
        raise StartError(f"video jobs: {e}") from None


def _listen(cfg: ServeConfig, start: _Start) -> None:
    """Bind the HTTP port first: a port in use is refused at once, before the folder is read or torch
    is imported (seconds on a loaded node), not after the other checks."""
    host, port = cfg.api.host, cfg.api.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    start.listener = sock


def _plan(cfg: ServeConfig, start: _Start) -> None:
    """The deployment plan (`dlo.plan.deployment.plan_folder`): the device budget against the
    pipeline at its limits, the decode rule, the mode, the resident blocks, an auto merge cache."""
    from dlo.plan.budget import DeviceBudgetError
    from dlo.plan.deployment import plan_folder
    from dlo.plan.measured import describe_needs
    from dlo.plan.profile import profile_from_file
    from dlo.serving.host import local_profile

    ask = cfg.plan_ask(start.device, start.dp, start.adapter_bytes, start.adapter_merges_bytes)
    try:
        host = local_profile(start.device)
        profile = profile_from_file(host, cfg.layout.profile) if cfg.layout.profile is not None else host
        req = cfg.requests  # no limits given: the largest that fit the budget
        derive = req.limits is None and not req.small_limits and req.max_size is None
        start.plan = plan_folder(start.model_dir, ask, profile=profile, limits=start.limits,
                                 device_memory=host.accelerator.memory_bytes, derive_limits=derive,
                                 measure=start_measure(cfg, start))  # each limit set weighed measured first
    except DeviceBudgetError as e:
        raise StartError(str(e)) from None
    except (ValueError, OSError) as e:  # an unreadable or invalid --profile file
        raise StartError(f"--profile: {e}") from None
    for line in start.plan.reasons:
        log.info("%s", line)
    for line in describe_needs(start.plan.needs):  # measured against predicted, per phase the plan weighs
        log.info("peak need: %s", line)
    if start.plan.limits is not None and start.plan.limits != start.limits:
        start.limits = start.plan.limits  # derived: what /v1/models reports and requests are held to
    log.info("serving %s family=%s %s", start.model_dir, start.facts.family, start.plan.describe())


def _tenants(cfg: ServeConfig) -> Any:
    """Who may call: the keys read once (`dlo.serving.tenants`; a bad file is one line, exit 2)."""
    from dlo.serving.api_keys import ApiKeyError
    from dlo.serving.tenants import tenants_from

    try:
        tenants = tenants_from(cfg.api, os.environ)
    except ApiKeyError as e:
        raise StartError(str(e)) from None
    return tenants


def _prepare(cfg: ServeConfig) -> _Start:
    """Every check that needs no rank, in order; `StartError` names the first problem. Each step's
    seconds are a lap of `start.laps` (the `before_load_phases` of `/ready`)."""
    start = _Start(model_dir=cfg.model_dir.resolve(), laps=start_laps())
    start.laps.lap("before_checks")  # the interpreter, the imports of `dlo`, the arguments, a --fetch
    start.tenants = _tenants(cfg)
    for step in (_listen, _model_and_limits, _layout, _library_warmup, _plan, _video_store):
        step(cfg, start)
        start.laps.lap(step.__name__.lstrip("_"))
    log.info("%s", start.tenants.describe())  # once every check passed: a refusal stays one line
    return start


def _engine(cfg: ServeConfig, start: _Start) -> Any:
    """The service on rank 0, with its rank group's configuration and the video store."""
    from dlo.engine.ports import free_port
    from dlo.serving.control import RankConfig
    from dlo.serving.service import Engine, EngineOptions

    assert start.plan is not None
    try:
        settings = engine_settings(cfg, start.plan, os.environ)
    except ConfigError as e:
        raise StartError(str(e)) from None
    api, req = cfg.api, cfg.requests
    rank_cfg = RankConfig(
        model_dir=str(start.model_dir), settings=settings, master_port=free_port(), control_port=free_port(),
        max_sequence_length=start.limits.max_sequence_length,
        collective_timeout_s=max(1800.0, 4 * api.progress_timeout), log_format=api.log_format,
    )
    options = EngineOptions(progress_timeout_s=api.progress_timeout, max_queue=api.max_queue,
                            wave_window_ms=api.wave_window_ms, warmup=req.warmup, warmup_size=start.warmup_size,
                            warmup_steps=req.warmup_steps, shutdown_grace_s=api.shutdown_grace,
                            startup_timeout_s=req.startup_timeout, adapters=start.adapters, start_laps=start.laps,
                            plan=start.plan.to_dict(), vae_tiling=cfg.memory.vae_tiling)
    return Engine(rank_cfg, limits=start.limits, facts=start.facts,
                  model_id=api.served_model_name or start.model_dir.name, videos=start.videos, options=options)


def _fetch_model(cfg: ServeConfig) -> ServeConfig | int:
    """A model URI is fetched first (`dlo.delivery`, as `dlo fetch` does) and served by its name: the
    configuration with the folder, or the exit code of a fetch that failed."""
    if isinstance(cfg.model, Path):
        return cfg
    from dlo.delivery.errors import FetchError
    from dlo.delivery.fetch import serving_folder

    try:
        folder, name = serving_folder(cfg.model, os.environ)
    except FetchError as e:
        say(f"dlo serve: {e.reason}: {e}", logging.ERROR)
        return e.exit_code
    return dataclasses.replace(cfg, model=Path(folder),
                               api=dataclasses.replace(cfg.api, served_model_name=cfg.api.served_model_name or name))


def main(args: argparse.Namespace) -> int:
    from dlo.serving.library_noise import quiet_libraries

    quiet_libraries()  # before anything imports tqdm or diffusers (the ranks inherit its TQDM_DISABLE)
    configure_logging(args.log_format, args.log_level, text_format="rank0 %(levelname)s %(name)s %(message)s",
                      fields={"rank": 0})
    try:
        built = serve_config(args)
        start_tracing("dlo-serve")  # only where the OTEL_* variables ask for traces
    except (ConfigError, TracingError) as e:  # the LoRA flags disagreeing; an exporter not installed
        say(f"dlo serve: {e}", logging.ERROR)
        return 2
    fetched = _fetch_model(built)
    if isinstance(fetched, int):
        return fetched
    cfg = fetched
    try:
        start = _prepare(cfg)
        engine = _engine(cfg, start)
        start.laps.lap("engine")
    except StartError as e:
        say(f"dlo serve: {e}", logging.ERROR)
        from dlo.serving.prewarm import end_early_library_warmups

        end_early_library_warmups()  # never exit while a thread is inside the device's libraries
        return 2
    from dlo.serving.faults import install_http_faults
    from dlo.serving.request_trace import instrument_http
    from dlo.serving.server import create_app
    from dlo.serving.uvicorn_server import http_server

    engine.group.spawn()
    app = create_app(engine, start.tenants, start.peers)
    install_http_faults(app)  # test-only: a no-op unless DLO_TEST_HOOKS=1 and DLO_TEST_FAULTS say so
    instrument_http(app)  # a span per API request, only while tracing is on
    server = http_server(cfg.api, engine, app)
    assert start.listener is not None
    server.run(sockets=[start.listener])
    code = engine.exit_code or (0 if server.started else 1)
    log.info("dlo serve exiting with code %d%s", code, f": {engine.failure}" if engine.failure else "")
    flush_traces(5.0)  # os._exit skips the exporter's own flush at exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # a rank thread may still sit in a collective after a fault: never wait for it
    os._exit(code)
