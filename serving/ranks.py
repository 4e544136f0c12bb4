"""Rank 0's side of the rank processes of `dlo serve`: process tree, control plane, progress watchdog.

Process tree: the `dlo serve` process is rank 0 (HTTP, scheduler, and a compute rank); it spawns
ranks 1..dp-1 as children (`python -m dlo.serving.rank_main`). A child dies with its parent
(Linux parent-death signal, and end-of-file on its control connection); the parent exits non-zero
when a child dies.

Two planes:
- the *weight plane* is torch.distributed (gloo on CPU, nccl/hccl on accelerators): only the
  engine's gathers travel there, in the same order on every rank;
- the *control plane* is one authenticated local socket per child (`multiprocessing.connection`,
  key passed through the environment) carrying the frozen messages of `control.py`: rank 0 sends
  each wave's assignments, children send progress ticks, results and errors back. It lives outside
  the collective so that a dead or stalled rank is seen at once (end-of-file, or no progress tick)
  instead of hanging everyone in a collective, and idle periods between waves never hit a
  collective timeout. No shared memory segments are created, so a killed rank leaks none.

Watchdog: while a wave runs, every rank that still owes a result must tick (before each
transformer block, after each step, on each weight gather) at least once per
`progress_timeout`; a long wave that keeps progressing is never cut. A death or a stall fails the
wave (`on_fault`), after which the process group is never reused: the server answers 503 and
exits non-zero so the pod restarts.

Control socket: rank 0 listens on loopback with a backlog of `CONTROL_BACKLOG` and keeps accepting
until every child has connected, each connection on its own handshake thread with a deadline
(`HANDSHAKE_S`: authentication with the per-start key, then a `Hello` naming a spawned child's rank
and pid): a local peer that connects and stays silent, or speaks without the key, is dropped once
its deadline passes and never takes a child's place; children that have not all connected within
`CONNECT_DEADLINE_S` fail the start.

Owns: `RankGroup` (spawn, start, run_wave, stop, abandon, kill), the control socket's accept, and the watchdog.
Must never: let a child outlive rank 0, reuse a communicator after a fault, or wait without a
deadline for a connection at start.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Callable

from dlo.engine.ports import free_port
from dlo.serving.child_env import child_env
from dlo.serving.control import (
    Hello,
    Progress,
    RankConfig,
    RankFailure,
    RankStats,
    Ready,
    Result,
    StepProgress,
    Stop,
    WaveAssignment,
    WaveError,
)
from dlo.serving.rank_main import (
    AUTHKEY_ENV,
    CONFIG_ENV,
    RANK_ENV,
    leave,
    gathers,
    init_rank,
    ready_message,
    run_assignment,
)
from dlo.engine.request import Generation

log = logging.getLogger(__name__)

READER_DRAIN_S = 2.0  # how long the monitor lets an exited rank's last messages arrive before blaming the exit
CONTROL_BACKLOG = 64  # pending connections: a few strangers cannot fill the queue before the children
HANDSHAKE_S = 10.0  # one connection: the key's challenge both ways, then Hello
CONNECT_DEADLINE_S = 120.0  # every child connects right after its interpreter starts (few imports)
ACCEPT_POLL_S = 0.5

__all__ = ["RankGroup", "RankState", "RankConfig", "WaveError", "free_port"]


@dataclass
class RankState:
    rank: int
    pid: int = 0
    proc: subprocess.Popen | None = None
    conn: Connection | None = None
    reader: threading.Thread | None = None  # receives on `conn`; ends at end-of-file
    ready: Ready | None = None
    stats: RankStats | None = None
    last_progress: float = 0.0
    pending: bool = False  # owes a result for the running wave
    steps_done: int = 0  # denoising steps of its current request (last progress report)
    result: Result | None = None


class RankGroup:
    """Rank 0's view of all ranks: spawns the children, runs waves, watches progress."""

    def __init__(self, cfg: RankConfig, progress_timeout_s: float, on_fault: Callable[[str], None]):
        self.cfg = cfg
        self.progress_timeout_s = progress_timeout_s
        self.on_fault = on_fault
        self.ranks = [RankState(r) for r in range(cfg.world)]  # dp x sp
        self.progress = Progress()
        self.pipe: Any = None
        self.failed: str | None = None
        self.stopping = False
        self._wave_no = 0
        self._cond = threading.Condition()
        self._authkey = secrets.token_bytes(32)
        self._listener: socket.socket | None = None

    # -- start ------------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Spawn ranks 1..dp x sp - 1. Call from the main thread: Linux sends the parent-death signal when
        the *thread* that forked a child exits, so a short-lived thread would kill the children."""
        self.listen()
        env = child_env()
        env.update({CONFIG_ENV: self.cfg.to_json(), AUTHKEY_ENV: self._authkey.hex()})
        for st in self.ranks[1:]:
            st.proc = subprocess.Popen([sys.executable, "-m", "dlo.serving.rank_main"],
                                       env={**env, RANK_ENV: str(st.rank)})
            st.pid = st.proc.pid
        threading.Thread(target=self._monitor, name="rank-monitor", daemon=True).start()

    def listen(self) -> None:
        """Open the control socket (loopback) the children connect to."""
        self._listener = socket.create_server(("127.0.0.1", self.cfg.control_port), backlog=CONTROL_BACKLOG)
        self._listener.settimeout(ACCEPT_POLL_S)

    def start(self) -> None:
        """Load rank 0's pipeline and wait until every rank is ready (blocking; after `spawn`)."""
        self._accept_children()
        self.pipe = init_rank(self.cfg, 0)
        self.progress = Progress(gathers(self.pipe))
        self.pipe.tick = self.progress.tick
        self.ranks[0].ready = ready_message(self.pipe)
        self.ranks[0].stats = self.ranks[0].ready.stats
        with self._cond:
            self._cond.wait_for(lambda: self.failed or all(st.ready for st in self.ranks))
        if self.failed:
            raise WaveError(self.failed)
        log.info("all %d ranks ready", self.cfg.world)

    def _accept_children(self) -> None:
        """Accept on the control socket until every child has shaken hands (a child that dies before
        is caught by the monitor); each connection is judged on its own thread, within HANDSHAKE_S."""
        assert self._listener is not None
        deadline = time.monotonic() + CONNECT_DEADLINE_S
        while not self._children_connected():
            if self.failed:
                raise WaveError(self.failed)
            if time.monotonic() > deadline:
                missing = [st.rank for st in self.ranks[1:] if st.conn is None]
                raise WaveError(f"rank(s) {missing} did not connect to the control socket within "
                                f"{CONNECT_DEADLINE_S:g} s of their start")
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), name="control-handshake", daemon=True).start()
        self._listener.close()  # every child is in: nobody else is ever accepted
        self._listener = None

    def _children_connected(self) -> bool:
        with self._cond:
            return all(st.conn is not None for st in self.ranks[1:])

    def _handshake(self, sock: socket.socket, peer: Any) -> None:
        """Authenticate one connection and read its Hello; anything else within HANDSHAKE_S is dropped."""
        sock.setblocking(True)
        conn = Connection(os.dup(sock.fileno()))
        timer = threading.Timer(HANDSHAKE_S, lambda: _shut(sock))  # wakes the blocked read below
        timer.start()
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            hello = conn.recv()
            st = self._claim(hello, conn)
        except Exception as e:  # a wrong key, a timeout, garbage, an impostor: this connection only
            log.warning("control socket: dropped a connection from %s:%s that did not authenticate and say Hello "
                        "within %g s: %s", peer[0], peer[1], HANDSHAKE_S, type(e).__name__)
            conn.close()
            return
        finally:
            timer.cancel()
            sock.close()
        st.reader = threading.Thread(target=self._reader, args=(st,), name=f"rank{st.rank}-reader", daemon=True)
        st.reader.start()

    def _claim(self, hello: object, conn: Connection) -> RankState:
        """The child a Hello names: a spawned child's rank and pid, not yet connected."""
        if not isinstance(hello, Hello):
            raise ValueError(f"opened with {type(hello).__name__}, not Hello")
        if not 1 <= hello.rank < len(self.ranks) or self.ranks[hello.rank].pid != hello.pid:
            raise ValueError(f"Hello names rank {hello.rank} pid {hello.pid}, which is no child of this server")
        with self._cond:
            st = self.ranks[hello.rank]
            if st.conn is not None:
                raise ValueError(f"rank {hello.rank} is connected already")
            st.conn = conn
            self._cond.notify_all()
        return st

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
            with self._cond:
                st.last_progress = time.monotonic()
                if isinstance(msg, StepProgress):
                    st.steps_done = msg.steps_done
                elif isinstance(msg, Ready):
                    st.ready, st.stats = msg, msg.stats
                elif isinstance(msg, Result):
                    st.result, st.pending, st.stats = msg, False, msg.stats
                self._cond.notify_all()
            if isinstance(msg, RankFailure):
                self.fault(msg.message)

    def _check_children(self) -> bool:
        """Fault (and True) if a child rank has exited."""
        for st in self.ranks[1:]:
            rc = st.proc.poll() if st.proc else None
            if rc is not None and not self.stopping:
                if st.reader is not None:
                    # What the rank said before it exited (a RankFailure naming the cause) is still
                    # in the connection: its reader delivers it, then sees end-of-file, first.
                    st.reader.join(timeout=READER_DRAIN_S)
                self.fault(f"rank {st.rank} (pid {st.pid}) {_exit_words(rc)}")  # a no-op after the cause
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
                # A rank stalled in a collective stops its peers too: blame the one that stopped first.
                st = min(stalled, key=lambda s: s.last_progress)
                self.fault(f"rank {st.rank} made no progress for {now - st.last_progress:.1f} s "
                           f"(--progress-timeout {self.progress_timeout_s:g})")
                return

    # -- waves ------------------------------------------------------------------------------------
    def run_wave(self, assignments: list[Generation | None]) -> list[Result]:
        """Run one wave (blocking): assignments[r] runs on rank r, None ranks only gather.

        Returns every rank's `Result` (rank order). Raises `WaveError` on a fault.
        """
        if self.failed:
            raise WaveError(self.failed)
        if len(assignments) != self.cfg.world:
            raise ValueError(f"a wave needs {self.cfg.world} assignments, got {len(assignments)}")
        wave_gen = next(g for g in assignments if g is not None)
        self._wave_no += 1
        now = time.monotonic()
        with self._cond:
            for st in self.ranks:
                st.pending, st.result, st.last_progress, st.steps_done = True, None, now, 0
        for st, gen in zip(self.ranks[1:], assignments[1:]):
            assert st.conn is not None
            st.conn.send(WaveAssignment(self._wave_no, wave_gen, gen))
        self.progress.tick()
        try:
            res0 = run_assignment(self.pipe, self.cfg, self._wave_no, assignments[0], wave_gen)
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
            st0.result, st0.pending, st0.stats = res0, False, res0.stats
            self._cond.wait_for(lambda: self.failed or not any(st.pending for st in self.ranks))
            if self.failed:
                raise WaveError(self.failed)
            return [st.result for st in self.ranks]  # type: ignore[misc]

    def steps_done(self, rank: int) -> int:
        """Denoising steps the rank's current request has finished (rank 0: live; others: last report)."""
        return self.pipe.steps_done if rank == 0 and self.pipe is not None else self.ranks[rank].steps_done

    def kill(self) -> None:
        """Last resort (a fault left a thread stuck in a collective): SIGKILL every live child now."""
        self.stopping = True
        for st in self.ranks[1:]:
            if st.proc is not None and st.proc.poll() is None:
                st.proc.kill()

    def abandon(self) -> None:
        """Shutdown with a wave still running (the drain's grace ran out): the ranks are inside
        their collective and would not read a `Stop`. SIGKILL the children and reap them; rank 0
        leaves nothing (the process exits next, the OS reclaims its communicator)."""
        self.kill()
        for st in self.ranks[1:]:
            if st.proc is not None:
                try:
                    st.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                    log.error("rank %d (pid %d) survived SIGKILL for 5 s", st.rank, st.pid)
        if self._listener is not None:
            self._listener.close()

    # -- stop -------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child (politely, then SIGKILL) and leave the process group."""
        self.stopping = True
        for st in self.ranks[1:]:
            if st.conn is not None and not self.failed:
                try:
                    st.conn.send(Stop())
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if not self.failed else 0.5)
        # Rank 0 leaves the group while the children leave theirs: an NCCL teardown waits for its
        # peers, so rank 0 waiting for the children to exit first would wait for ever (bounded
        # anyway by `leave`).
        leave(self.pipe, clean=not self.failed)
        for st in self.ranks[1:]:
            if st.proc is None:
                continue
            try:
                st.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not exit within the grace; killing it", st.rank)
                st.proc.kill()
                st.proc.wait()
        if self._listener is not None:
            self._listener.close()


def _shut(sock: socket.socket) -> None:
    """End a handshake that took too long: shutdown wakes a thread blocked reading the socket."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _exit_words(rc: int | None) -> str:
    if rc is None:
        return "closed its control connection"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"
