"""The HTTP/1.1 connection of `dlo serve`: uvicorn's h11 protocol with our limits and framing rules.

Owns: `guarded_protocol(guard)`, the protocol class uvicorn runs for every connection, which applies
the `ConnectionGuard` (`dlo.serving.connections`): the cap and the probe reserve at accept,
the idle/header timeout, the body timeout and minimum body rate. And the framing rules of RFC 9112
that uvicorn leaves to the application:
- a request head (request line and header fields) is at most `MAX_HEAD_BYTES` (16 KiB, as
  docs/serving.md says): beyond, 431 in OpenAI's error shape and close, whether it arrives whole or
  in pieces;
- a request with both Content-Length and Transfer-Encoding is framed by Transfer-Encoding and the
  connection is closed after its response (section 6.3): nothing behind it on that connection is
  read;
- a head h11 cannot parse gets 400 in OpenAI's JSON shape, not uvicorn's plain text.
Must never: time out a request whose response is under way, or read past a request whose framing
it does not trust.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dlo.serving.connections import PROBE_PATHS, ConnectionGuard, error_response

MAX_HEAD_BYTES = 16 * 1024
BODY_CHECK_EVERY_S = 1.0
# After an answer written on the transport, what the client still sends is read and dropped for at
# most this long before the close: closing with unread data would reset the connection, and the
# client could lose the answer (RFC 9112 9.6, "tear-down").
LINGER_S = 2.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a guard's limits and the framing rules above (`guarded_protocol`
    binds the guard)."""

    guard: ConnectionGuard
    _idle_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _place: str | None = None
    _discarding = False
    _body_start = 0.0
    _body_bytes = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # heads that arrive in pieces are bounded by h11 itself; whole ones in data_received
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)

    # -- accept ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._place = self.guard.admit(self.client[0] if self.client else None)
        if self._place is None:
            self._answer_and_close(self.guard.refusal())
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_body_clock()
        self.guard.release(self._place)
        self._place = None
        super().connection_lost(exc)

    # -- what arrives ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return  # answered already: read and dropped until the close
        if self.conn.their_state is h11.IDLE and not self._head_acceptable(data):
            return
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)
        super().data_received(data)

    def _head_acceptable(self, data: bytes) -> bool:
        """The head being received fits MAX_HEAD_BYTES and, on a probe place, asks for a probe path."""
        buffered = self.conn.trailing_data[0] + data
        end = buffered.find(b"\r\n\r\n")
        if (end < 0 and len(buffered) > MAX_HEAD_BYTES) or end > MAX_HEAD_BYTES:
            self._answer_and_close(error_response(
                431, "Request Header Fields Too Large", "headers_too_large",
                f"the request head exceeds this server's limit of {MAX_HEAD_BYTES} bytes"))
            return False
        if self._place == "probe":
            line = buffered.split(b"\r\n", 1)
            if len(line) == 1 and len(buffered) < MAX_HEAD_BYTES:
                return True  # the request line is not complete yet
            method, _, rest = line[0].partition(b" ")
            path = rest.partition(b" ")[0].split(b"?", 1)[0].decode("latin-1")
            if method not in (b"GET", b"HEAD") or path not in PROBE_PATHS:
                self.guard.refuse()
                self._answer_and_close(self.guard.refusal())
                return False
        return True

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._disarm()  # a complete request head arrived
            names = {name for name, _ in self.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                cycle.keep_alive = False  # RFC 9112 6.3: close after responding
            if self.conn.their_state is h11.SEND_BODY and self._body_timer is None:
                self._start_body_clock()
        if self.conn.their_state is not h11.SEND_BODY:
            self._stop_body_clock()

    def send_400_response(self, msg: str) -> None:
        self._answer_and_close(error_response(400, "Bad Request", "invalid_http",
                                              f"the request is not valid HTTP/1.1: {msg}"))

    def _answer_and_close(self, response: bytes) -> None:
        """Answer on the transport itself (nothing of this request reached the app), end our side,
        and close after what the client still sends was read (at most LINGER_S)."""
        self._disarm()
        self._stop_body_clock()
        if self.cycle is not None and not self.cycle.response_started:
            self.cycle.response_started = self.cycle.disconnected = True  # the app's sends are dropped
            self.cycle.message_event.set()
        if self.transport.is_closing() or self._discarding:
            return
        self._discarding = True
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    # -- the head's timer ------------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._idle_timer = self.loop.call_later(self.guard.idle_timeout_s, self._idle_timeout)

    def _disarm(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: never cut here
        if not self.transport.is_closing():
            self.guard.idle_closed()
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the next request head must come within the timeout too

    # -- the body's clock ------------------------------------------------------------------------
    def _start_body_clock(self) -> None:
        self._body_start, self._body_bytes = time.monotonic(), 0
        self._body_timer = self.loop.call_later(BODY_CHECK_EVERY_S, self._check_body)

    def _stop_body_clock(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _check_body(self) -> None:
        """mod_reqtimeout's rule: the timeout, plus one second per min-body-rate bytes received."""
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        lim = self.guard.limits
        allowed = lim.body_timeout_s + self._body_bytes / lim.min_body_rate
        if self.flow.read_paused:  # we stopped reading (the app is behind): not the client's delay
            self._body_start += BODY_CHECK_EVERY_S
        elif time.monotonic() - self._body_start > allowed:
            self.guard.slow_body()
            self._answer_and_close(error_response(
                408, "Request Timeout", "request_timeout",
                f"the request body did not arrive within --body-timeout {lim.body_timeout_s:g} s plus 1 s per "
                f"{lim.min_body_rate} bytes received ({self._body_bytes} bytes came)"))
            return
        self._body_timer = self.loop.call_later(BODY_CHECK_EVERY_S, self._check_body)


def guarded_protocol(guard: ConnectionGuard) -> type:
    """The protocol class uvicorn runs (`http=`), bound to `guard`."""
    return type("BoundGuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
