"""Connection limits of `dlo serve`'s HTTP listener: caps, timeouts, quiet logs.

Owns: `ConnectionLimits` (what the flags set), `ConnectionGuard` (the limits, who counts against
them, their counters and log episodes; the protocol that applies them is
`dlo.serving.http_protocol`), the descriptor limit at start (`raise_nofile_limit`,
`default_max_connections`), and the event-loop exception handler that turns asyncio's per-attempt
"socket.accept() out of system resource" errors into one log line per episode.

- Cap (`--max-connections`): a connection beyond it is answered at once with a 503 in OpenAI's
  error shape (`too_many_connections`, Retry-After) and closed, so open descriptors stay bounded
  below RLIMIT_NOFILE and the listener keeps accepting.
- Probe reserve: a connection over the cap from a probe address (loopback, or a `--probe-cidr`
  network: the kubelet's node address, Prometheus) takes one of `PROBE_RESERVE` extra places, on
  which only GET/HEAD of `/health`, `/ready` and `/metrics` are served: the cap never starves the
  probes, and nobody else can use the reserve.
- Idle/header timeout (`--idle-timeout`): a connection must deliver a complete request head within
  the timeout of opening, or of its previous response; otherwise it is closed.
- Body timeout and minimum rate (`--body-timeout`, `--min-body-rate`): once a head announced a
  body, the body must be complete within the timeout plus one second per `min-body-rate` bytes
  received (Apache's mod_reqtimeout rule), else 408 and close: a client that stops or trickles its
  body cannot hold a place. A request being answered is never timed out here.
- Logs: one line when an episode starts (cap reached, descriptor limit reached) and one when it
  ends, with counts; idle and slow-body closes are summed over `SUMMARY_EVERY_S`. Never one line
  per connection or per failed accept.
Must never: log per connection or per accept attempt, or time out a request whose response is
under way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

FD_RESERVE = 256  # for the engine itself (model files, sockets, logs) and one accept batch (asyncio: 100)
SUMMARY_EVERY_S = 10.0
EPISODE_QUIET_S = 2.0  # an episode ends after this long without a new occurrence
ACCEPT_ERROR = "socket.accept() out of system resource"
PROBE_RESERVE = 16  # places beyond the cap for probe addresses (each kubelet probe and scrape is one)
PROBE_PATHS = ("/health", "/ready", "/metrics")
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take of the listener (the `dlo serve` flags)."""

    max_connections: int
    idle_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    min_body_rate: int = 4096  # bytes per second once the body timeout is used up
    probe_networks: tuple[Any, ...] = field(default=LOOPBACK)


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
    """The listener's limits, who holds a place, and what they refused (shared by every connection)."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.max_connections = limits.max_connections
        self.idle_timeout_s = limits.idle_timeout_s
        self.open = 0  # connections holding a place under the cap
        self.probes_open = 0  # connections on the probe reserve
        self.refused_total = 0
        self.idle_closed_total = 0
        self.slow_body_total = 0
        self.accept_errors_total = 0
        self._idle_since_summary = 0
        self._slow_since_summary = 0
        self._over_cap = _Episode(
            "connections: the cap of {cap} open connections is reached (--max-connections): new connections "
            "get 503 too_many_connections until some close (probe addresses keep a reserve of "
            f"{PROBE_RESERVE} for /health, /ready, /metrics)",
            "connections: back under the cap of {cap}: {count} connections were refused over {seconds:.1f} s")
        self._no_fds = _Episode(
            "connections: the descriptor limit (RLIMIT_NOFILE {nofile}) is reached: new connections wait in the "
            "listen backlog until some close; lower --max-connections below the limit",
            "connections: accepting again: {count} accept attempts failed for lack of descriptors over "
            "{seconds:.1f} s")
        self._task: asyncio.Task | None = None

    def is_probe_address(self, host: str | None) -> bool:
        try:
            address = ipaddress.ip_address(host or "")
        except ValueError:
            return False
        return any(address in net for net in self.limits.probe_networks)

    def admit(self, host: str | None) -> str | None:
        """Where a new connection goes: "open" (a place under the cap), "probe" (the reserve: probe
        paths only), or None (refused)."""
        if self.open < self.max_connections:
            self.open += 1
            return "open"
        if self.probes_open < PROBE_RESERVE and self.is_probe_address(host):
            self.probes_open += 1
            return "probe"
        self.refuse()
        return None

    def release(self, place: str | None) -> None:
        if place == "open":
            self.open -= 1
        elif place == "probe":
            self.probes_open -= 1

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
        lim = self.limits
        log.info("connections: max_connections=%d idle_timeout_seconds=%g body_timeout_seconds=%g "
                 "min_body_rate=%d probe_reserve=%d probe_networks=%s nofile=%d", lim.max_connections,
                 lim.idle_timeout_s, lim.body_timeout_s, lim.min_body_rate, PROBE_RESERVE,
                 ",".join(str(n) for n in lim.probe_networks), nofile_limit())

    async def _watch(self) -> None:
        last_summary = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            self._over_cap.settle(cap=self.max_connections)
            self._no_fds.settle()
            now = time.monotonic()
            if (self._idle_since_summary or self._slow_since_summary) and now - last_summary >= SUMMARY_EVERY_S:
                log.info("connections: closed %d connections that sent no complete request head within "
                         "--idle-timeout %g s and %d whose body was slower than --body-timeout %g s plus 1 s per "
                         "--min-body-rate %d bytes (last %.0f s)", self._idle_since_summary, self.idle_timeout_s,
                         self._slow_since_summary, self.limits.body_timeout_s, self.limits.min_body_rate,
                         now - last_summary)
                self._idle_since_summary = self._slow_since_summary = 0
                last_summary = now

    # -- connection side ----------------------------------------------------------------------------
    def refuse(self) -> None:
        self.refused_total += 1
        self._over_cap.hit(cap=self.max_connections)

    def idle_closed(self) -> None:
        self.idle_closed_total += 1
        self._idle_since_summary += 1

    def slow_body(self) -> None:
        self.slow_body_total += 1
        self._slow_since_summary += 1

    def refusal(self) -> bytes:
        return error_response(503, "Service Unavailable", "too_many_connections",
                              f"this server holds its maximum of {self.max_connections} connections; retry shortly",
                              "service_unavailable_error", retry_after=1)


def error_response(status: int, reason: str, code: str, message: str, kind: str = "invalid_request_error",
                   retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes the connection (written on the
    transport itself, for what is refused before a request reaches the app)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    retry = b"retry-after: " + str(retry_after).encode() + b"\r\n" if retry_after is not None else b""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n".encode() + retry +
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
