"""Connection limits of `dlo serve`'s HTTP listener: a cap, an idle/header timeout, quiet logs.

Owns: `ConnectionGuard` (the limits and their counters), the uvicorn HTTP protocol that applies
them (`guarded_protocol`), the descriptor limit at start (`raise_nofile_limit`, `default_max_connections`),
and the event-loop exception handler that turns asyncio's per-attempt "socket.accept() out of system
resource" errors into one log line per episode.

- Cap (`--max-connections`): a connection beyond it is answered at once with a 503 in OpenAI's
  error shape (`too_many_connections`, Retry-After) and closed, so open descriptors stay bounded
  below RLIMIT_NOFILE and the listener keeps accepting.
- Idle/header timeout (`--idle-timeout`): a connection must deliver a complete request head within
  the timeout of opening, or of its previous response; otherwise it is closed (slow or silent
  clients cannot hold descriptors). A request being served is never timed out here.
- Logs: one line when an episode starts (cap reached, descriptor limit reached) and one when it
  ends, with counts; idle closes are summed over `SUMMARY_EVERY_S`. Never one line per connection
  or per failed accept.
Must never: log per connection or per accept attempt, or time out a request whose response is
under way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any

log = logging.getLogger(__name__)

FD_RESERVE = 256  # for the engine itself (model files, sockets, logs) and one accept batch (asyncio: 100)
SUMMARY_EVERY_S = 10.0
EPISODE_QUIET_S = 2.0  # an episode ends after this long without a new occurrence
ACCEPT_ERROR = "socket.accept() out of system resource"


def nofile_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard one (a common low soft default must not cap
    connections); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(nofile: int) -> int:
    """Connections the descriptor limit allows with a reserve for the engine, at most 1024."""
    return max(8, min(1024, nofile - FD_RESERVE))


class _Episode:
    """Something that happens in bursts: one line when it starts, one when it ends (with a count)."""

    def __init__(self, start: str, end: str):
        self.start_words, self.end_words = start, end
        self.count = 0
        self.started = 0.0
        self.last = 0.0
        self.active = False

    def hit(self, **ctx: Any) -> None:
        now = time.monotonic()
        self.count += 1
        self.last = now
        if not self.active:
            self.active, self.started = True, now
            log.warning(self.start_words.format(**ctx))

    def settle(self, **ctx: Any) -> None:
        if self.active and time.monotonic() - self.last >= EPISODE_QUIET_S:
            log.warning(self.end_words.format(count=self.count, seconds=self.last - self.started, **ctx))
            self.active, self.count = False, 0


class ConnectionGuard:
    """The listener's limits and what they refused (shared by every connection's protocol)."""

    def __init__(self, max_connections: int, idle_timeout_s: float):
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.refused_total = 0
        self.idle_closed_total = 0
        self.accept_errors_total = 0
        self._idle_since_summary = 0
        self._over_cap = _Episode(
            "connections: the cap of {cap} open connections is reached (--max-connections): new connections "
            "get 503 too_many_connections until some close",
            "connections: back under the cap of {cap}: {count} connections were refused over {seconds:.1f} s")
        self._no_fds = _Episode(
            "connections: the descriptor limit (RLIMIT_NOFILE {nofile}) is reached: new connections wait in the "
            "listen backlog until some close; lower --max-connections below the limit",
            "connections: accepting again: {count} accept attempts failed for lack of descriptors over "
            "{seconds:.1f} s")
        self._task: asyncio.Task | None = None

    # -- loop side ----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        previous = loop.get_exception_handler()

        def handler(lp: asyncio.AbstractEventLoop, context: dict) -> None:
            if context.get("message") == ACCEPT_ERROR:
                self.accept_errors_total += 1
                self._no_fds.hit(nofile=nofile_limit())
                return
            if previous is not None:
                previous(lp, context)
            else:
                lp.default_exception_handler(context)

        loop.set_exception_handler(handler)
        self._task = loop.create_task(self._watch())
        log.info("connections: max_connections=%d idle_timeout_seconds=%g nofile=%d", self.max_connections,
                 self.idle_timeout_s, nofile_limit())

    async def _watch(self) -> None:
        last_summary = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            self._over_cap.settle(cap=self.max_connections)
            self._no_fds.settle()
            now = time.monotonic()
            if self._idle_since_summary and now - last_summary >= SUMMARY_EVERY_S:
                log.info("connections: closed %d connections that sent no complete request within "
                         "--idle-timeout %g s (last %.0f s)", self._idle_since_summary, self.idle_timeout_s,
                         now - last_summary)
                self._idle_since_summary = 0
                last_summary = now

    # -- connection side ----------------------------------------------------------------------------
    def refuse(self) -> None:
        self.refused_total += 1
        self._over_cap.hit(cap=self.max_connections)

    def idle_closed(self) -> None:
        self.idle_closed_total += 1
        self._idle_since_summary += 1

    def refusal(self) -> bytes:
        body = json.dumps({"error": {
            "message": f"this server holds its maximum of {self.max_connections} connections; retry shortly",
            "type": "service_unavailable_error", "param": None, "code": "too_many_connections"}}).encode()
        return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's h11 protocol with the guard's cap and idle/header timeout."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _idle_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > guard.max_connections:
                guard.refuse()
                transport.write(guard.refusal())
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._idle_timer = self.loop.call_later(guard.idle_timeout_s, self._idle_timeout)

        def _disarm(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        def _idle_timeout(self) -> None:
            self._idle_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served: never cut here
            if not self.transport.is_closing():
                guard.idle_closed()
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a complete request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the next request head must come within the timeout too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
