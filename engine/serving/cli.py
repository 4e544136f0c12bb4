"""Serve a diffusers pipeline folder over an OpenAI-compatible HTTP API, on dp ranks.

`dlo serve MODEL_DIR` starts rank 0 (this process: HTTP, wave scheduler, and a compute rank) and
spawns ranks 1..dp-1. The transformer runs through the DLO engine in the chosen mode; text
encoders and the VAE load normally on every rank. See docs/serving.md for the API.

Owns: the `dlo serve` options, refusing a broken folder before any rank starts, resolving
`--mode auto` (the pure `dlo.agent.policy` over a profile built from the engine's own device facts),
and wiring the service, the rank group and the HTTP server together.
Must never: import anything of `dlo.agent` but the pure `policy` and `profile` (CONTRACTS.md
section 1), or take a secret from the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

from dlo.engine.facts import Mode, ModeOrAuto
from dlo.engine.serving.options import add_arguments, engine_settings
from dlo.engine.settings import ConfigError, from_environment

__all__ = ["add_arguments", "main", "engine_settings", "resolve_mode", "read_api_key"]


def read_api_key(path: Path | None) -> str | None:
    if path is not None:
        key = path.read_text().strip()
        if not key:
            raise SystemExit(f"dlo serve: {path} is empty")
        return key
    return os.environ.get("DLO_API_KEY") or None


def local_profile(device: str) -> Any:
    """This host's `NodeProfile` from the engine's own device facts (torch, NVML for NVLink) and the
    nominal bandwidths of `dlo.agent.profile`; with no accelerator (cpu) the policy budgets
    "device" weights in host RAM."""
    from dlo.agent.profile import Accelerator, Interconnect, NodeProfile, nominal_collective_bps, nominal_h2d_bps
    from dlo.engine.devices import device_facts

    f = device_facts(device)
    acc = Accelerator(vendor=f.vendor, model=f.model, count=f.count, memory_bytes=f.memory_bytes)
    h2d = nominal_h2d_bps(f.model) if f.vendor != "none" else 0
    coll = nominal_collective_bps(f.model, f.interconnect, None) if f.vendor != "none" else 0
    return NodeProfile(
        node=socket.gethostname(), accelerator=acc,
        interconnect=Interconnect(kind=f.interconnect, collective_bandwidth_bps=coll),
        h2d_bandwidth_bps=h2d, host_memory_bytes=f.host_memory_bytes,
        can_register_page_cache=f.vendor == "nvidia",  # the engine DMAs from the page cache on cuda
    )


def resolve_mode(mode: ModeOrAuto, model_dir: Path, dp: int, device: str, profile_path: Path | None = None,
                 sp: int = 1, *, max_device_memory: int = 0, memory: Any = None,
                 resident_blocks: int | str = 0) -> tuple[Mode, str]:
    """The engine mode and why: `--mode` as given, else the node policy, else a fixed rule. With the
    deployment's `memory` (`dlo.engine.serving.budget`) the device budget is checked: a mode that does
    not fit raises `DeviceBudgetError` (exit 2 before anything loads)."""
    if mode != "auto":
        if memory is not None and device != "cpu":
            from dlo.engine.serving.budget import check_mode, local_budget

            budget = local_budget(local_profile(device).accelerator.memory_bytes, max_device_memory, memory)
            log.info("%s", check_mode(mode, memory, budget, dp * sp, resident_blocks))
        return mode, "--mode given"
    try:
        from dlo.agent.policy import NoModeFits, PolicyError, choose_mode
        from dlo.agent.profile import CalibrationFragment, NodeProfile, apply_calibration, parse_file
    except ImportError:
        log.warning("dlo.agent.policy is not installed; using the fixed rule")
    else:
        from dlo.engine.blocks import describe

        profile = local_profile(device)
        if profile_path is not None:  # a file a person gave: any problem in it is an error (ProfileError)
            text = profile_path.read_text()
            try:
                whole = isinstance(data := json.loads(text), dict) and "version" in data
            except ValueError:
                whole = False  # parse_file says what is wrong with it
            if whole:  # a whole NodeProfile (e.g. the agent's /profile)
                profile = parse_file(NodeProfile, text, str(profile_path))
            else:  # a `dlo calibrate` fragment
                profile = apply_calibration(profile, parse_file(CalibrationFragment, text, str(profile_path)))
        try:
            decision = choose_mode(profile, describe(model_dir / "transformer"), dp, sp=sp,
                                   device_budget_bytes=max_device_memory or None, pipeline=memory)
            return decision.engine_mode, f"policy: {decision.reason}"
        except NoModeFits as e:
            from dlo.engine.serving.budget import DeviceBudgetError

            raise DeviceBudgetError(f"--mode auto: {e}") from None
        except (PolicyError, ValueError) as e:
            log.warning("mode policy gave no answer (%s); using the fixed rule", e)
    if dp * sp > 1:
        return "allgather", "fixed rule: dp x sp > 1"
    return "rank-local", "fixed rule: dp = 1"


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


def _attention_heads(model_dir: Path) -> int | None:
    """The transformer's attention heads (Ulysses splits them over the sp ranks), if its config says."""
    from dlo.engine.checkpoint import CheckpointError, read_json_config

    try:
        heads = read_json_config(model_dir / "transformer" / "config.json").get("num_attention_heads")
    except CheckpointError:
        return None
    return heads if isinstance(heads, int) else None


def _server_class(engine: Any, guard: Any) -> type:
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """SIGTERM/SIGINT drain the engine first (`Engine.begin_drain`), which then asks uvicorn to
        exit: uvicorn's own graceful shutdown would cancel the handlers still waiting for their wave
        with a plain-text 500. A signal before the engine runs, or once the exit is under way, is
        uvicorn's as usual. uvicorn re-raises the signal after a graceful shutdown; a requested stop
        exits 0 instead."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            guard.start(asyncio.get_running_loop())

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            loop = engine.loop
            if self.should_exit or loop is None or loop.is_closed():
                super().handle_exit(sig, frame)
            else:
                loop.call_soon_threadsafe(engine.begin_drain)
            getattr(self, "_captured_signals", []).clear()

    return Server


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="rank0 %(levelname)s %(name)s %(message)s")
    import uvicorn

    from dlo.engine.checkpoint import CheckpointError, cached_checkpoint
    from dlo.engine.families import pipeline_facts
    from dlo.engine.devices import device_count, resolve_device
    from dlo.engine.ports import free_port
    from dlo.engine.serving.connections import (
        FD_RESERVE,
        ConnectionGuard,
        default_max_connections,
        guarded_protocol,
        raise_nofile_limit,
    )
    from dlo.engine.serving.control import RankConfig
    from dlo.engine.serving.limits import SMALL, Limits
    from dlo.engine.serving.api_models import ApiError
    from dlo.engine.serving.server import create_app
    from dlo.engine.serving.peers import Peers
    from dlo.engine.serving.service import Engine
    from dlo.engine.serving.videos import VideoStore, default_video_dir

    if isinstance(args.model_dir, str):  # a model URI: fetched first (dlo.delivery), served by its name
        from dlo.delivery.errors import FetchError
        from dlo.delivery.fetch import serving_folder

        try:
            args.model_dir, name = serving_folder(args.model_dir, os.environ)
        except FetchError as e:
            print(f"dlo serve: {e.reason}: {e}", file=sys.stderr)
            return e.exit_code
        args.served_model_name = args.served_model_name or name
    model_dir: Path = args.model_dir.resolve()
    try:
        facts = pipeline_facts(model_dir)
        # Headers, index and shard files, torch-free: most broken checkpoints are refused here, before
        # any rank starts; dtypes and shapes are checked against the model when each rank loads. The
        # parse is cached: the mode policy's model facts and rank 0's load reuse it.
        cached_checkpoint(model_dir / "transformer")
        limits = Limits.load(args.limits, SMALL if args.small_limits else None, max_steps=args.max_steps,
                             max_width=args.max_size, max_height=args.max_size)
        warmup_size = _warmup_size(args.warmup_size, facts, limits)
    except ApiError as e:
        print(f"dlo serve: --warmup-size: {e.message}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"dlo serve: refusing a broken checkpoint: CheckpointError: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"dlo serve: {e}", file=sys.stderr)
        return 2
    api_key = read_api_key(args.api_key_file)
    device = resolve_device(args.device)
    from dlo.engine.parallel import LayoutError, check_layout, check_tokens

    sp = args.sp
    devices = device_count(device) if device != "cpu" else None
    dp = args.dp or max(1, (devices or 1) // max(1, sp))
    try:
        check_layout(dp, sp, devices, _attention_heads(model_dir), args.sp_kind)
        if sp > 1 and facts.no_sp:
            raise LayoutError(f"--sp {sp}: the {facts.family} family runs without sequence parallelism: {facts.no_sp}")
        if sp > 1 and args.sp_kind == "ring" and device != "cuda":
            raise LayoutError("--sp-kind ring needs cuda (diffusers' ring attention needs an attention backend "
                              "that returns the log-sum-exp); use --sp-kind ulysses")
        if warmup_size is not None:
            check_tokens(*warmup_size, facts.size_multiple, sp)
        from_environment(os.environ)  # the DLO_* switches: a bad one is refused before anything loads
    except ConfigError as e:
        print(f"dlo serve: {e}", file=sys.stderr)
        return 2
    if args.shutdown_grace < 0:
        print("dlo serve: --shutdown-grace must be >= 0", file=sys.stderr)
        return 2
    if (args.max_connections is not None and args.max_connections < 1) or args.idle_timeout <= 0:
        print("dlo serve: --max-connections must be >= 1 and --idle-timeout > 0", file=sys.stderr)
        return 2
    if args.max_device_memory and device not in ("cuda", "npu"):
        print(f"dlo serve: --max-device-memory needs a cuda or npu device; --device resolved to {device}",
              file=sys.stderr)
        return 2
    from dlo.engine.serving.budget import DeviceBudgetError, budget_inputs

    try:  # the device budget against the pipeline at its limits (dlo.engine.serving.budget)
        mode, why = resolve_mode(args.mode, model_dir, dp, device, args.profile, sp=sp,
                                 **budget_inputs(args, model_dir, limits))
    except DeviceBudgetError as e:
        print(f"dlo serve: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # an unreadable or invalid --profile file
        print(f"dlo serve: --profile: {e}", file=sys.stderr)
        return 2
    log.info("serving %s family=%s mode=%s (%s) dp=%d sp=%d device=%s", model_dir, facts.family, mode, why, dp, sp,
             device)
    try:
        settings = engine_settings(args, mode, device, dp, os.environ)
    except ConfigError as e:
        print(f"dlo serve: {e}", file=sys.stderr)
        return 2
    cfg = RankConfig(
        model_dir=str(model_dir), settings=settings, master_port=free_port(), control_port=free_port(),
        max_sequence_length=limits.max_sequence_length, collective_timeout_s=max(1800.0, 4 * args.progress_timeout),
    )
    try:  # video jobs: the store names this pod in its ids; peers answer for the other pods' jobs
        videos = VideoStore(args.video_dir or default_video_dir(args.port), ttl_s=args.video_ttl,
                            pod=os.environ.get("DLO_POD_NAME") or None)
        videos.load()
        peers = Peers.from_env()
    except (ValueError, OSError) as e:
        print(f"dlo serve: video jobs: {e}", file=sys.stderr)
        return 2
    engine = Engine(cfg, limits=limits, facts=facts, model_id=args.served_model_name or model_dir.name,
                    progress_timeout_s=args.progress_timeout, max_queue=args.max_queue,
                    wave_window_ms=args.wave_window_ms, warmup=args.warmup, warmup_size=warmup_size,
                    videos=videos, shutdown_grace_s=args.shutdown_grace)
    engine.group.spawn()
    app = create_app(engine, api_key, peers)
    nofile = raise_nofile_limit()
    max_connections = args.max_connections or default_max_connections(nofile)
    if max_connections > nofile - FD_RESERVE:
        log.warning("--max-connections %d leaves fewer than %d of RLIMIT_NOFILE %d for the engine: accepts may "
                    "fail for lack of descriptors", max_connections, FD_RESERVE, nofile)
    guard = ConnectionGuard(max_connections, args.idle_timeout)
    # uvicorn's graceful timeout only guards a stop that did not come through the drain: above the
    # grace, so it never cancels a handler the drain still lets finish.
    server = _server_class(engine, guard)(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, http=guarded_protocol(guard),
        timeout_keep_alive=max(1, int(args.idle_timeout)), timeout_graceful_shutdown=int(args.shutdown_grace) + 5))
    engine.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    code = engine.exit_code or (0 if server.started else 1)
    log.info("dlo serve exiting with code %d%s", code, f": {engine.failure}" if engine.failure else "")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # a rank thread may still sit in a collective after a fault: never wait for it
    os._exit(code)
