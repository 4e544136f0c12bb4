"""The rank processes of `dlo serve`: process tree, control plane, progress watchdog.

Process tree: the `dlo serve` process is rank 0 (HTTP, scheduler, and a compute rank); it spawns
ranks 1..dp-1 as children (`python -m dlo.engine.ranks`). A child dies with its parent (Linux
parent-death signal, and end-of-file on its control connection); the parent exits non-zero when a
child dies.

Two planes:
- the *weight plane* is torch.distributed (gloo on CPU, nccl/hccl on accelerators): only the
  engine's gathers travel there, in the same order on every rank;
- the *control plane* is one authenticated local socket per child (`multiprocessing.connection`,
  key passed through the environment): rank 0 sends each wave's assignments, children send
  progress ticks, results and errors back. It lives outside the collective so that a dead or
  stalled rank is seen at once (end-of-file, or no progress tick) instead of hanging everyone in a
  collective, and idle periods between waves never hit a collective timeout. No shared memory
  segments are created, so a killed rank leaks none.

Watchdog: while a wave runs, every rank that still owes a result must tick (before each
transformer block, after each step, on each weight gather) at least once per
`progress_timeout`; a long wave that keeps progressing is never cut. A death or a stall fails the
wave (`on_fault`), after which the process group is never reused: the server answers 503 and
exits non-zero so the pod restarts.
Must never: let a child outlive rank 0, or reuse a communicator after a fault.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable

from dlo.engine.waves import Generation

log = logging.getLogger(__name__)

CONFIG_ENV = "DLO_RANK_CONFIG"
RANK_ENV = "DLO_RANK"
AUTHKEY_ENV = "DLO_CONTROL_AUTHKEY"
# Rank 0 alone answers HTTP: the children never see the API key, not even in their environment.
API_KEY_ENV = "DLO_API_KEY"


class WaveError(RuntimeError):
    """A wave could not finish: a rank died, stalled, or failed. The engine must restart."""


@dataclass
class RankConfig:
    model_dir: str
    mode: str  # allgather | rank-local | resident (already resolved)
    device: str  # cpu | cuda | npu
    dp: int
    master_port: int
    control_port: int
    max_sequence_length: int = 512
    cpu_threads: int = 1
    resident_blocks: int | str = 0  # or "auto" (dlo.engine.load sizes it from free device memory)
    collective_timeout_s: float = 1800.0
    weights: str = "auto"  # auto | arena | registered (dlo.engine.load's host source of block bytes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (no orphans even if rank 0 is killed)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        log.warning("parent-death signal unavailable; relying on control-plane end-of-file")


class Progress:
    """Monotonic tick counter and time of the last tick (written by the compute thread).

    `watch` (optional) is a counter the watchdog polls, such as the engine's gather count: it
    moves once per block even on a rank that only gathers, whose own ticks come once per call.
    """

    def __init__(self, watch: Callable[[], int] | None = None) -> None:
        self.count = 0
        self.last = time.monotonic()
        self.watch = watch
        self._watched = watch() if watch else 0

    def tick(self) -> None:
        self.count += 1
        self.last = time.monotonic()

    def poll(self) -> None:
        if self.watch is not None:
            value = self.watch()
            if value != self._watched:
                self._watched = value
                self.tick()


def _gathers(pipe: Any) -> Callable[[], int]:
    return lambda: pipe.model.stats().gathers


def init_rank(cfg: RankConfig, rank: int) -> Any:
    """Join the weight plane and load the pipeline; returns the `ServingPipeline`."""
    import torch
    import torch.distributed as dist

    from dlo.engine.pipeline import ServingPipeline
    from dlo.engine.platform import get_platform

    if cfg.device == "cpu":
        # A fixed thread count keeps CPU results bit-identical whatever dp is.
        torch.set_num_threads(cfg.cpu_threads)
    platform = get_platform(cfg.device)
    device = platform.device(rank)
    backend = platform.backend
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{cfg.master_port}", rank=rank, world_size=cfg.dp,
        timeout=timedelta(seconds=cfg.collective_timeout_s),
    )
    return ServingPipeline(cfg.model_dir, mode=cfg.mode, device=device, max_sequence_length=cfg.max_sequence_length,
                           resident_blocks=cfg.resident_blocks, weights=cfg.weights)


def run_assignment(pipe: Any, mode: str, mine: dict | None, wave_gen: dict) -> dict:
    """Run this rank's share of a wave: its own request, or only the gathers the wave implies."""
    if mine is not None:
        res = pipe.run(Generation.from_dict(mine))
        out: dict[str, Any] = {"outputs": res.outputs, "media_type": res.media_type,
                               "step_seconds": res.step_seconds, "seconds": res.seconds}
    else:
        if mode == "allgather":
            pipe.gather_only(Generation.from_dict(wave_gen))
        out = {"outputs": None}
    out["stats"] = pipe.stats()
    return out


def load_facts(pipe: Any) -> dict:
    return {"report": pipe.report.to_dict(), "components": pipe.component_bytes, "stats": pipe.stats()}


# ---- child side ---------------------------------------------------------------------------------
def worker_main() -> int:
    rank = int(os.environ[RANK_ENV])
    cfg = RankConfig(**json.loads(os.environ[CONFIG_ENV]))
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    _die_with_parent()
    # Ctrl-C in a terminal (or a signal to the whole process group) is rank 0's to handle: it stops
    # the children in order; a child dying first would look like a rank failure.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(levelname)s %(name)s %(message)s")
    conn = Client(("127.0.0.1", cfg.control_port), authkey=authkey)
    lock = threading.Lock()

    def send(msg: dict) -> None:
        with lock:
            conn.send(msg)

    send({"type": "hello", "rank": rank, "pid": os.getpid()})
    progress = Progress()
    try:
        pipe = init_rank(cfg, rank)
        progress = Progress(_gathers(pipe))
        pipe.tick = progress.tick
        send({"type": "ready", **load_facts(pipe)})
    except Exception as e:
        log.exception("rank %d failed to load", rank)
        send({"type": "error", "message": f"rank {rank} failed to load: {e}"})
        return 1

    stop = threading.Event()

    def report_progress() -> None:
        seen = progress.count
        while not stop.wait(0.2):
            progress.poll()
            if progress.count != seen:
                seen = progress.count
                try:
                    send({"type": "progress", "steps_done": pipe.steps_done})
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
            if msg["type"] == "stop":
                return 0
            if msg["type"] == "wave":
                progress.tick()
                send({"type": "result", "wave": msg["wave"],
                      **run_assignment(pipe, cfg.mode, msg["assignment"], msg["wave_gen"])})
    except Exception as e:
        log.exception("rank %d failed", rank)
        try:
            send({"type": "error", "message": f"rank {rank} failed: {type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1
    finally:
        stop.set()
        _destroy_group()


def _destroy_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the group may be broken after a fault; the process is exiting anyway
        log.debug("destroy_process_group failed", exc_info=True)


# ---- rank 0 side --------------------------------------------------------------------------------
@dataclass
class RankState:
    rank: int
    pid: int = 0
    proc: subprocess.Popen | None = None
    conn: Connection | None = None
    ready: dict | None = None
    stats: dict | None = None
    last_progress: float = 0.0
    pending: bool = False  # owes a result for the running wave
    steps_done: int = 0  # denoising steps of its current request (last progress report)
    result: dict | None = None


class RankGroup:
    """Rank 0's view of all ranks: spawns the children, runs waves, watches progress."""

    def __init__(self, cfg: RankConfig, progress_timeout_s: float, on_fault: Callable[[str], None]):
        self.cfg = cfg
        self.progress_timeout_s = progress_timeout_s
        self.on_fault = on_fault
        self.ranks = [RankState(r) for r in range(cfg.dp)]
        self.progress = Progress()
        self.pipe: Any = None
        self.failed: str | None = None
        self.stopping = False
        self._wave_no = 0
        self._cond = threading.Condition()
        self._authkey = secrets.token_bytes(32)
        self._listener: Listener | None = None

    # -- start ------------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Spawn ranks 1..dp-1. Call from the main thread: Linux sends the parent-death signal when
        the *thread* that forked a child exits, so a short-lived thread would kill the children."""
        self._listener = Listener(("127.0.0.1", self.cfg.control_port), authkey=self._authkey)
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        env.update({CONFIG_ENV: json.dumps(asdict(self.cfg)), AUTHKEY_ENV: self._authkey.hex()})
        for st in self.ranks[1:]:
            st.proc = subprocess.Popen([sys.executable, "-m", "dlo.engine.ranks"], env={**env, RANK_ENV: str(st.rank)})
            st.pid = st.proc.pid
        threading.Thread(target=self._monitor, name="rank-monitor", daemon=True).start()

    def start(self) -> None:
        """Load rank 0's pipeline and wait until every rank is ready (blocking; after `spawn`)."""
        assert self._listener is not None
        for _ in self.ranks[1:]:
            # blocks; a child that dies before connecting is caught by the monitor (fault -> exit)
            conn = self._listener.accept()
            hello = conn.recv()
            st = self.ranks[hello["rank"]]
            st.conn = conn
            threading.Thread(target=self._reader, args=(st,), name=f"rank{st.rank}-reader", daemon=True).start()
        self.pipe = init_rank(self.cfg, 0)
        self.progress = Progress(_gathers(self.pipe))
        self.pipe.tick = self.progress.tick
        self.ranks[0].ready = load_facts(self.pipe)
        self.ranks[0].stats = self.ranks[0].ready["stats"]
        with self._cond:
            self._cond.wait_for(lambda: self.failed or all(st.ready for st in self.ranks))
        if self.failed:
            raise WaveError(self.failed)
        log.info("all %d ranks ready", self.cfg.dp)

    # -- fault handling ---------------------------------------------------------------------------
    def fault(self, reason: str) -> None:
        with self._cond:
            if self.failed or self.stopping:
                return
            self.failed = reason
            self._cond.notify_all()
        log.error("engine fault: %s", reason)
        try:
            self.on_fault(reason)
        except Exception:
            log.exception("fault handler failed")

    def _reader(self, st: RankState) -> None:
        assert st.conn is not None
        while True:
            try:
                msg = st.conn.recv()
            except (EOFError, OSError):
                if not self.stopping:
                    try:
                        rc = st.proc.wait(timeout=5) if st.proc else None
                    except subprocess.TimeoutExpired:
                        rc = None  # alive but cut off from rank 0: as broken as dead
                    self.fault(f"rank {st.rank} (pid {st.pid}) {_exit_words(rc)}")
                return
            kind = msg["type"]
            with self._cond:
                st.last_progress = time.monotonic()
                if kind == "progress":
                    st.steps_done = msg.get("steps_done", 0)
                elif kind == "ready":
                    st.ready = msg
                    st.stats = msg["stats"]
                elif kind == "result":
                    st.result, st.pending = msg, False
                    st.stats = msg["stats"]
                self._cond.notify_all()
            if kind == "error":
                self.fault(msg["message"])

    def _check_children(self) -> bool:
        """Fault (and True) if a child rank has exited."""
        for st in self.ranks[1:]:
            rc = st.proc.poll() if st.proc else None
            if rc is not None and not self.stopping:
                self.fault(f"rank {st.rank} (pid {st.pid}) {_exit_words(rc)}")
                return True
        return False

    def _monitor(self) -> None:
        while not self.failed and not self.stopping:
            time.sleep(0.1)
            if self._check_children():
                return
            self.progress.poll()
            now = time.monotonic()
            with self._cond:
                self.ranks[0].last_progress = max(self.ranks[0].last_progress, self.progress.last)
                stalled = [st for st in self.ranks if st.pending and now - st.last_progress > self.progress_timeout_s]
            if stalled:
                st = stalled[0]
                self.fault(f"rank {st.rank} made no progress for {now - st.last_progress:.1f} s "
                           f"(--progress-timeout {self.progress_timeout_s:g})")
                return

    # -- waves ------------------------------------------------------------------------------------
    def run_wave(self, assignments: list[Generation | None]) -> list[dict]:
        """Run one wave (blocking): assignments[r] runs on rank r, None ranks only gather.

        Returns every rank's result dict (rank order). Raises `WaveError` on a fault.
        """
        if self.failed:
            raise WaveError(self.failed)
        if len(assignments) != self.cfg.dp:
            raise ValueError(f"a wave needs {self.cfg.dp} assignments, got {len(assignments)}")
        wave_gen = next(g for g in assignments if g is not None).to_dict()
        self._wave_no += 1
        now = time.monotonic()
        with self._cond:
            for st in self.ranks:
                st.pending, st.result, st.last_progress, st.steps_done = True, None, now, 0
        for st, gen in zip(self.ranks[1:], assignments[1:]):
            assert st.conn is not None
            st.conn.send({"type": "wave", "wave": self._wave_no, "wave_gen": wave_gen,
                          "assignment": gen.to_dict() if gen else None})
        self.progress.tick()
        mine = assignments[0].to_dict() if assignments[0] else None
        try:
            res0 = run_assignment(self.pipe, self.cfg.mode, mine, wave_gen)
        except Exception as e:
            # A dead peer breaks the collective under rank 0, often before its exit is noticed:
            # give the peer's fault a moment to be seen so the 503 names the rank that died.
            deadline = time.monotonic() + 2.0
            while not self.failed and not self._check_children() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.failed:  # another rank failed first and broke the collective under us
                log.warning("rank 0 stopped in wave %d after the fault: %s: %s", self._wave_no, type(e).__name__, e)
            else:
                log.exception("rank 0 failed in wave %d", self._wave_no)
                self.fault(f"rank 0 failed: {type(e).__name__}: {e}")
            raise WaveError(self.failed or str(e)) from e
        with self._cond:
            st0 = self.ranks[0]
            st0.result, st0.pending, st0.stats = res0, False, res0["stats"]
            self._cond.wait_for(lambda: self.failed or not any(st.pending for st in self.ranks))
            if self.failed:
                raise WaveError(self.failed)
            return [st.result for st in self.ranks]  # type: ignore[misc]

    def steps_done(self, rank: int) -> int:
        """Denoising steps the rank's current request has finished (rank 0: live; others: last report)."""
        return self.pipe.steps_done if rank == 0 and self.pipe is not None else self.ranks[rank].steps_done

    # -- stop -------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child (politely, then SIGKILL) and leave the process group."""
        self.stopping = True
        for st in self.ranks[1:]:
            if st.conn is not None and not self.failed:
                try:
                    st.conn.send({"type": "stop"})
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if not self.failed else 0.5)
        for st in self.ranks[1:]:
            if st.proc is None:
                continue
            try:
                st.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                st.proc.kill()
                st.proc.wait()
        if not self.failed:
            _destroy_group()
        if self._listener is not None:
            self._listener.close()


def _exit_words(rc: int | None) -> str:
    if rc is None:
        return "closed its control connection"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


if __name__ == "__main__":
    sys.exit(worker_main())
