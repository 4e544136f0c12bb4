"""The compute side of a rank, and the main of ranks 1..dp-1 (`python -m dlo.serving.rank_main`).

Owns: joining the weight plane and loading the `ServingPipeline` (`init_rank`, every rank, rank 0
included), running one rank's share of a wave (`run_assignment`), and a child's loop: `Hello`, then
`Ready` (or `RankFailure`), then one `Result` per `WaveAssignment` until `Stop` or end-of-file, with
`StepProgress` ticks from a reporter thread. Messages are the frozen types of `control.py`.
Must never: outlive rank 0 (parent-death signal; end-of-file on the control connection exits), or
handle SIGINT/SIGTERM itself (rank 0 stops the children in order).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta
from multiprocessing.connection import Client
from typing import Callable

from dlo.serving.control import (
    Hello,
    Progress,
    RankConfig,
    RankFacts,
    RankFailure,
    Ready,
    RequestError,
    Result,
    StepProgress,
    Stop,
    WaveAssignment,
)
from dlo.cli.logs import configure_logging
from dlo.serving.child_env import die_with_parent
from dlo.serving.distmap import start_distribution_map
from dlo.serving.faults import InjectedFault, install_rank_faults
from dlo.serving.library_noise import quiet_libraries
from dlo.serving.phase_marks import mark_text_encoding
from dlo.serving.pipeline import ServingPipeline
from dlo.serving.warm_run import run_warm_up
from dlo.engine.timing import Laps
from dlo.engine.request import Generation

log = logging.getLogger(__name__)

CONFIG_ENV = "DLO_RANK_CONFIG"
RANK_ENV = "DLO_RANK"
AUTHKEY_ENV = "DLO_CONTROL_AUTHKEY"


def gathers(pipe: ServingPipeline) -> Callable[[], int]:
    """The watchdog's second progress signal: the engine's gather count."""
    return lambda: pipe.model.stats().gathers


def init_rank(cfg: RankConfig, rank: int) -> ServingPipeline:
    """Join the weight plane and load the pipeline; returns the `ServingPipeline`."""
    import torch

    from dlo.engine.parallel import make_groups
    from dlo.engine.platform import get_platform
    from dlo.serving.rendezvous import join_weight_plane

    settings = cfg.settings
    if cfg.device == "cpu":
        # A fixed thread count keeps CPU results bit-identical whatever dp is.
        torch.set_num_threads(settings.cpu_threads)
    laps = Laps()  # where a rank's time goes before its pipeline load (the load's own phases follow)
    platform = get_platform(cfg.device)
    device = platform.device(rank)
    torch.empty(1, device=device)  # the device context is created here, not inside a later phase
    laps.lap("device_init")
    join_weight_plane(platform.backend, cfg.master_port, rank, cfg.world, timedelta(seconds=cfg.collective_timeout_s))
    laps.lap("process_group")
    # dp x sp: the shard group is every rank (the default group, or its own communicator when the
    # gathers' CTAs are capped); sp groups are consecutive ranks
    parallel = make_groups(settings.parallel, device, gathers=cfg.mode == "allgather",
                           timeout=timedelta(seconds=cfg.collective_timeout_s))
    laps.lap("groups")
    log.info("rank %d joined the weight plane: phases=%s", rank, laps.rounded())
    pipe = ServingPipeline(cfg.model_dir, settings, device=device, group=parallel.shard_group, parallel=parallel,
                           max_sequence_length=cfg.max_sequence_length)
    pipe.load_phases = {**laps.rounded(), **pipe.load_phases}  # the rank's start, in order
    install_rank_faults(pipe, rank)  # the test-only seam: installs nothing without DLO_TEST_HOOKS=1 and a plan
    mark_text_encoding(pipe)  # the `text_encode` marks of a request's trace
    return pipe


def ready_message(pipe: ServingPipeline) -> Ready:
    return Ready(RankFacts(pipe.report, dict(pipe.component_bytes), pipe.component_reports(),
                           dict(pipe.load_phases)), pipe.stats())


def run_assignment(pipe: ServingPipeline, cfg: RankConfig, wave: int, mine: Generation | None,
                   wave_gen: Generation) -> Result:
    """Run this rank's share of a wave: its own request, or only the gathers the wave implies.

    Fault model by phase: a request that fails outside the collective schedule (text encoding,
    scheduler set-up, between transformer calls, VAE decode, PNG/MP4 encoding) fails alone: the
    rank still issues the gathers of the transformer calls it owes the wave (allgather) and returns
    a `Result` carrying a `RequestError`. A fault that breaks the schedule (a collective error, a
    forward stopped between blocks: `PrefetchOrderError` or the order no longer intact) raises:
    the rank fails and the engine restarts.
    """
    if mine is not None:
        calls0 = dict(pipe.calls_done)
        try:
            res = run_warm_up(pipe, mine) if mine.warmup else pipe.run(mine)
        except Exception as e:
            client_fault = isinstance(e, UnicodeError)
            # sp > 1: the request's sp group shares attention collectives, so only a failure every
            # rank of the group meets the same way (its own input) can be isolated.
            if breaks_collective(e) or not pipe.order_intact() or (cfg.sp > 1 and not client_fault):
                raise
            phase = pipe.phase
            pipe.phase = "idle"
            done = {name: n - calls0.get(name, 0) for name, n in pipe.calls_done.items()}
            owed = pipe.owed_calls(mine, done)
            log.warning("request failed alone wave=%d phase=%s error=%s: %s owed_calls=%d", wave, phase,
                        type(e).__name__, e, owed, exc_info=not isinstance(e, InjectedFault))
            if cfg.mode == "allgather" and owed > 0:
                pipe.gather_only(mine, done=done)
            err = RequestError(phase, type(e).__name__, f"{type(e).__name__}: {e}",
                               client_fault=client_fault)
            return Result(wave, pipe.stats(), error=err, timeline=tuple(pipe.clock.timeline))
        # sp > 1: every rank of the sp group ran the request; its first rank returns the output
        outputs = tuple(res.outputs) if getattr(pipe, "returns_outputs", True) else None
        return Result(wave, pipe.stats(), outputs, res.media_type, tuple(res.step_seconds), res.seconds,
                      phase_seconds=dict(res.phase_seconds), timeline=tuple(pipe.clock.timeline))
    if cfg.mode == "allgather":
        pipe.gather_only(wave_gen)
    return Result(wave, pipe.stats())


def breaks_collective(e: BaseException) -> bool:
    """A fault that leaves the weight plane untrustworthy: the engine must restart."""
    from dlo.engine import PrefetchOrderError

    if isinstance(e, PrefetchOrderError):
        return True
    try:
        import torch.distributed as dist

        dist_error = getattr(dist, "DistError", None)
    except ImportError:  # pragma: no cover
        dist_error = None
    return dist_error is not None and isinstance(e, dist_error)


LEAVE_GROUP_TIMEOUT_S = 5.0


def leave(pipe: ServingPipeline | None, clean: bool) -> None:
    """A rank's teardown: the pipeline (transfer graphs, hooks, DMA registrations) first, then the
    process group, bounded. After a fault (`clean` False) the communicator is not touched: a peer may
    be gone and the teardown would wait for it; the process exit reclaims everything."""
    from dlo.engine.platform import leave_group

    if not clean:
        return
    if pipe is not None:
        try:
            pipe.close()
        except Exception:  # exiting anyway: say so, never hang on it
            log.warning("closing the pipeline failed", exc_info=True)
    leave_group(LEAVE_GROUP_TIMEOUT_S)


def main() -> int:
    rank = int(os.environ[RANK_ENV])
    cfg = RankConfig.from_json(os.environ[CONFIG_ENV])
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    die_with_parent()
    # Ctrl-C in a terminal (or a signal to the whole process group) is rank 0's to handle: it stops
    # the children in order; a child dying first would look like a rank failure.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    quiet_libraries()
    configure_logging(cfg.log_format, logging.INFO, text_format=f"rank{rank} %(levelname)s %(name)s %(message)s",
                      fields={"rank": rank})
    start_distribution_map()  # beside torch's import in init_rank (distmap.py)
    conn = Client(("127.0.0.1", cfg.control_port), authkey=authkey)
    lock = threading.Lock()

    def send(msg: object) -> None:
        with lock:
            conn.send(msg)

    send(Hello(rank, os.getpid()))
    pipe = None
    clean = False
    try:
        pipe = init_rank(cfg, rank)
        progress = Progress(gathers(pipe))
        pipe.tick = progress.tick
        send(ready_message(pipe))
    except Exception as e:
        log.exception("rank %d failed to load", rank)
        send(RankFailure(f"rank {rank} failed to load: {e}"))
        return 1

    stop = threading.Event()

    def report_progress() -> None:
        seen = progress.count
        while not stop.wait(0.2):
            progress.poll()
            if progress.count != seen:
                seen = progress.count
                try:
                    send(StepProgress(pipe.steps_done))
                except OSError:
                    return

    threading.Thread(target=report_progress, name="progress", daemon=True).start()
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                log.warning("rank %d: control connection closed by rank 0; exiting", rank)
                return 1
            if isinstance(msg, Stop):
                clean = True
                return 0
            if isinstance(msg, WaveAssignment):
                progress.tick()
                send(run_assignment(pipe, cfg, msg.wave, msg.mine, msg.wave_gen))
    except Exception as e:
        log.exception("rank %d failed", rank)
        try:
            send(RankFailure(f"rank {rank} failed: {type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    finally:
        stop.set()
        leave(pipe, clean)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    # No interpreter teardown: a communicator left by timeout must not be destroyed again there.
    os._exit(code)
