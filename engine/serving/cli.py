"""Serve a diffusers pipeline folder over an OpenAI-compatible HTTP API, on dp ranks.

`dlo serve MODEL_DIR` starts rank 0 (this process: HTTP, wave scheduler, and a compute rank) and
spawns ranks 1..dp-1. The transformer runs through the DLO engine in the chosen mode; text
encoders and the VAE load normally on every rank. See docs/serving.md for the API.

Owns: the `dlo serve` start in named steps (`main`): everything a flag, the folder, the key or the
port can get wrong is refused in one line with exit 2 before any rank starts (`StartError`);
the mode (`mode_choice`); and wiring the service, the rank group and the HTTP server together.
Must never: import anything of `dlo.agent` but the pure `policy` and `profile` (CONTRACTS.md
section 1) and, through the readahead (`prewarm.start_early_readahead`), its torch-free page-cache
helpers (`residency`, `tree`, `warm`), take a secret from the command line, or start a rank before
the listening port is ours.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

from dlo.engine.facts import DeviceKind, Mode
from dlo.engine.serving.mode_choice import resolve_mode
from dlo.engine.serving.options import add_arguments, engine_settings
from dlo.engine.settings import ConfigError, from_environment
from dlo.engine.timing import Laps, start_laps

__all__ = ["add_arguments", "main", "engine_settings", "resolve_mode", "read_api_key", "StartError"]


class StartError(Exception):
    """A reason `dlo serve` cannot start: printed as one line, exit 2, before any rank starts."""


def read_api_key(path: Path | None, environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """The key from `--api-key-file` (UTF-8 text, white space around it ignored) or `DLO_API_KEY`.
    Clients send it in a header, so it must be printable ASCII: any other key could never match."""
    if path is not None:
        try:
            key = path.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise StartError(f"--api-key-file {path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise StartError(f"--api-key-file {path}: {e.strerror or e}") from None
        if not key:
            raise StartError(f"--api-key-file {path} is empty")
        where = f"--api-key-file {path}"
    else:
        key = environ.get("DLO_API_KEY") or ""
        where = "DLO_API_KEY"
        if not key:
            return None
    bad = next((c for c in key if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise StartError(f"{where}: the key holds {bad!r}; a key must be printable ASCII without spaces (clients "
                         "send it in an HTTP header, where any other character never matches)")
    return key


def _warmup_size(flag: str | None, facts: Any, limits: Any) -> tuple[int, int] | None:
    """The warm-up's size: `--warmup-size WxH` (an invalid one is an error: `ApiError`), `smallest`
    (None), or by default the limits' `default_size` - unless these limits refuse it (a `--max-size`
    below it, say: then no request without `size` runs either), when the smallest size is used."""
    from dlo.engine.serving.api_models import ApiError, parse_size

    if flag == "smallest":
        return None
    if flag:
        return parse_size(flag, facts, limits)
    try:
        return parse_size(limits.default_size, facts, limits)
    except ApiError as e:
        log.warning("warm-up at the smallest size: the limits' default_size does not fit them (%s)", e.message)
        return None


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


def _adapters(args: argparse.Namespace, start: "_Start") -> None:
    """The LoRA flags agreeing, the adapters checked, what every rank holds for them (the budget's)."""
    from dlo.engine.lora import all_merges_bytes, rank_device_bytes
    from dlo.engine.serving.options import cfg_pairs_asked, lora_settings

    lora = lora_settings(args)
    if lora.directory is None:
        return
    lora_dir = Path(lora.directory)  # resolved
    plans = _check_adapters(lora_dir, start.model_dir, start.facts, args.sp)
    start.adapters = {plan.name: plan.path.relative_to(lora_dir).parts[0] for plan in plans}
    # with CFG pairs a streamed block's merges are kept for the second lane (counted wherever they may run)
    kept = start.facts.adapter.blocks.block_lists if cfg_pairs_asked(args) and start.facts.adapter.cfg_pairs else ()
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
    api_key: str | None = None
    device: DeviceKind = "cpu"
    dp: int = 1
    mode: Mode = "rank-local"
    listener: socket.socket | None = None
    videos: Any = None
    peers: Any = None
    deployment: Any = None  # the pipeline at its limits on this device (dlo.engine.serving.budget)
    adapters: dict[str, str] = field(default_factory=dict)  # --lora-dir: name -> file or folder
    adapter_bytes: int = 0  # what every rank holds for them (`dlo.engine.lora.rank_device_bytes`)
    adapter_merges_bytes: int = 0  # the most a merge cache could hold (an auto cache's cap)


def _model_and_limits(args: argparse.Namespace, start: _Start) -> None:
    """The folder (headers, index and shards, torch-free: most broken checkpoints are refused here;
    dtypes and shapes are checked when each rank loads; the parse is cached for the policy and rank
    0), the limits, the warm-up size; a cold folder's readahead starts here."""
    from dlo.engine.checkpoint import CheckpointError, cached_checkpoint
    from dlo.engine.families import pipeline_facts
    from dlo.engine.lora import AdapterError
    from dlo.engine.serving.api_models import ApiError
    from dlo.engine.serving.limits import SMALL, Limits
    from dlo.engine.serving.prewarm import start_early_readahead

    try:
        start.facts = pipeline_facts(start.model_dir)
        cached_checkpoint(start.model_dir / "transformer")
        # a cold folder's reads start here, before torch is imported (rank 0's load adopts them)
        encoders = start.facts.adapter.streamable_encoders if args.stream_text_encoders else ()
        start_early_readahead(start.model_dir, (*start.facts.transformers, *encoders))
        start.limits = Limits.load(args.limits, SMALL if args.small_limits else None, max_steps=args.max_steps,
                                   max_width=args.max_size, max_height=args.max_size)
        start.warmup_size = _warmup_size(args.warmup_size, start.facts, start.limits)
        _adapters(args, start)
    except AdapterError as e:
        raise StartError(f"--lora-dir: refusing an adapter that does not fit the model: {e}") from None
    except ApiError as e:
        raise StartError(f"--warmup-size: {e.message}") from None
    except CheckpointError as e:
        raise StartError(f"refusing a broken checkpoint: CheckpointError: {e}") from None
    except (ValueError, OSError) as e:  # the limits file, the LoRA flags disagreeing (ConfigError)
        raise StartError(str(e)) from None


def _layout(args: argparse.Namespace, start: _Start) -> None:
    """Device, dp x sp, and the flags that depend on them; the `DLO_*` switches."""
    from dlo.engine.serving.distmap import start_distribution_map

    start_distribution_map()  # once the folder passed its checks; beside torch's import below (distmap.py)
    from dlo.engine.devices import device_count, resolve_device
    from dlo.engine.parallel import LayoutError, check_layout, check_tokens

    start.device = device = resolve_device(args.device)
    sp = args.sp
    devices = device_count(device) if device != "cpu" else None
    start.dp = args.dp or max(1, (devices or 1) // max(1, sp))
    try:
        check_layout(start.dp, sp, devices, _attention_heads(start.model_dir), args.sp_kind)
        if sp > 1 and start.facts.no_sp:
            raise LayoutError(f"--sp {sp}: the {start.facts.family} family runs without sequence parallelism: "
                              f"{start.facts.no_sp}")
        if sp > 1 and args.sp_kind == "ring" and device != "cuda":
            raise LayoutError("--sp-kind ring needs cuda (diffusers' ring attention needs an attention backend "
                              "that returns the log-sum-exp); use --sp-kind ulysses")
        if start.warmup_size is not None:
            check_tokens(*start.warmup_size, start.facts.size_multiple, sp)
        from_environment(os.environ)  # the DLO_* switches: a bad one is refused before anything loads
    except ConfigError as e:
        raise StartError(str(e)) from None
    if args.shutdown_grace < 0:
        raise StartError("--shutdown-grace must be >= 0")
    if (args.max_connections is not None and args.max_connections < 1) or args.idle_timeout <= 0:
        raise StartError("--max-connections must be >= 1 and --idle-timeout > 0")
    if args.max_device_memory and device not in ("cuda", "npu"):
        raise StartError(f"--max-device-memory needs a cuda or npu device; --device resolved to {device}")


def _library_warmup(args: argparse.Namespace, start: _Start) -> None:
    """On cuda, rank 0's (this process's) device libraries load beside the steps after this one."""
    if start.device == "cuda":
        from dlo.engine.serving.prewarm import start_early_library_warmup

        start_early_library_warmup("cuda:0")


def _video_store(args: argparse.Namespace, start: _Start) -> None:
    """Video jobs: the store names this pod in its ids; peers answer for the other pods' jobs."""
    from dlo.engine.serving.peers import Peers
    from dlo.engine.serving.videos import VideoStore, default_video_dir

    try:
        start.videos = VideoStore(args.video_dir or default_video_dir(args.port), ttl_s=args.video_ttl,
                                  pod=os.environ.get("DLO_POD_NAME") or None)
        start.videos.load()
        start.peers = Peers.from_env()
    except (ValueError, OSError) as e:
        raise StartError(f"video jobs: {e}") from None


def _listen(args: argparse.Namespace, start: _Start) -> None:
    """Bind the HTTP port now: a port in use is refused before anything loads, not after."""
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise StartError(f"--host {args.host} --port {args.port}: cannot listen there: {e.strerror or e}") from None
    start.listener = sock


def _budget(args: argparse.Namespace, start: _Start) -> None:
    """The device budget against the pipeline at its limits (`dlo.engine.serving.budget`), the mode."""
    from dlo.engine.serving.budget import DeviceBudgetError, budget_inputs, deployment

    try:
        start.deployment = deployment(args, start.model_dir, start.limits, start.device, start.adapter_bytes)
        start.mode, why = resolve_mode(args.mode, start.model_dir, start.dp, start.device, args.profile, sp=args.sp,
                                       **budget_inputs(args, start.deployment))
    except DeviceBudgetError as e:
        raise StartError(str(e)) from None
    except (ValueError, OSError) as e:  # an unreadable or invalid --profile file
        raise StartError(f"--profile: {e}") from None
    log.info("serving %s family=%s mode=%s (%s) dp=%d sp=%d device=%s", start.model_dir, start.facts.family,
             start.mode, why, start.dp, args.sp, start.device)


def _prepare(args: argparse.Namespace) -> _Start:
    """Every check that needs no rank, in order; `StartError` names the first problem. Each step's
    seconds are a lap of `start.laps` (the `before_load_phases` of `/ready`)."""
    start = _Start(model_dir=args.model_dir.resolve(), laps=start_laps())
    start.laps.lap("before_checks")  # the interpreter, the imports of `dlo`, the arguments, a --fetch
    start.api_key = read_api_key(args.api_key_file)
    for step in (_model_and_limits, _layout, _library_warmup, _budget, _video_store, _listen):
        step(args, start)
        start.laps.lap(step.__name__.lstrip("_"))
    return start


def _engine(args: argparse.Namespace, start: _Start) -> Any:
    """The service on rank 0, with its rank group's configuration and the video store."""
    from dlo.engine.ports import free_port
    from dlo.engine.serving.budget import plan_settings
    from dlo.engine.serving.control import RankConfig
    from dlo.engine.serving.service import Engine, EngineOptions

    try:  # resident blocks and VAE tiling from the budget, each decision logged with its arithmetic
        settings, lines = plan_settings(engine_settings(args, start.mode, start.device, start.dp, os.environ),
                                        start.deployment, start.adapter_merges_bytes)
    except ConfigError as e:
        raise StartError(str(e)) from None
    for line in lines:
        log.info("%s", line)
    cfg = RankConfig(
        model_dir=str(start.model_dir), settings=settings, master_port=free_port(), control_port=free_port(),
        max_sequence_length=start.limits.max_sequence_length,
        collective_timeout_s=max(1800.0, 4 * args.progress_timeout),
    )
    options = EngineOptions(progress_timeout_s=args.progress_timeout, max_queue=args.max_queue,
                            wave_window_ms=args.wave_window_ms, warmup=args.warmup, warmup_size=start.warmup_size,
                            warmup_steps=args.warmup_steps,
                            shutdown_grace_s=args.shutdown_grace, startup_timeout_s=args.startup_timeout,
                            adapters=start.adapters, start_laps=start.laps)
    return Engine(cfg, limits=start.limits, facts=start.facts, model_id=args.served_model_name or start.model_dir.name,
                  videos=start.videos, options=options)


def _fetch_model(args: argparse.Namespace) -> int:
    """A model URI is fetched first (`dlo.delivery`, as `dlo fetch` does) and served by its name;
    returns the exit code of a fetch that failed, else 0."""
    if not isinstance(args.model_dir, str):
        return 0
    from dlo.delivery.errors import FetchError
    from dlo.delivery.fetch import serving_folder

    try:
        args.model_dir, name = serving_folder(args.model_dir, os.environ)
    except FetchError as e:
        print(f"dlo serve: {e.reason}: {e}", file=sys.stderr)
        return e.exit_code
    args.served_model_name = args.served_model_name or name
    return 0


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="rank0 %(levelname)s %(name)s %(message)s")
    if code := _fetch_model(args):
        return code
    try:
        start = _prepare(args)
        engine = _engine(args, start)
        start.laps.lap("engine")
    except StartError as e:
        print(f"dlo serve: {e}", file=sys.stderr)
        from dlo.engine.serving.prewarm import end_early_library_warmups

        end_early_library_warmups()  # never exit while a thread is inside the device's libraries
        return 2
    from dlo.engine.serving.faults import install_http_faults
    from dlo.engine.serving.server import create_app
    from dlo.engine.serving.uvicorn_server import http_server

    engine.group.spawn()
    app = create_app(engine, start.api_key, start.peers)
    install_http_faults(app)  # test-only: a no-op unless DLO_TEST_HOOKS=1 and DLO_TEST_FAULTS say so
    server = http_server(args, engine, app)
    assert start.listener is not None
    server.run(sockets=[start.listener])
    code = engine.exit_code or (0 if server.started else 1)
    log.info("dlo serve exiting with code %d%s", code, f": {engine.failure}" if engine.failure else "")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # a rank thread may still sit in a collective after a fault: never wait for it
    os._exit(code)
