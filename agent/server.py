"""The node agent's HTTP server: `/metrics`, `/profile` and `/health` (aiohttp, on a thread of its own).

Owns: the routes, their content types and status codes (404 for an unknown path, 405 for another
method, 500 with a JSON error when a route fails), and the connection limits:
- one asyncio loop holds every connection (no thread per connection); the routes that read the
  host (`/metrics`, `/profile`) run on `WORKERS` threads, `/health` on the loop, so slow sources
  never delay it;
- a connection must deliver a complete request head within `Limits.head_timeout_s` of opening or of
  its previous response, else it is closed (aiohttp's keep-alive timer runs from the start);
- at most `Limits.max_connections` open connections, `Limits.per_address` from one client address:
  beyond either, a connection is answered 503 at once and closed (a flood from one address cannot
  take the kubelet's or Prometheus' place);
- a listen backlog of `BACKLOG`; heads and header lines bounded by aiohttp (8 KiB a line).
Must never: import torch, compute a metric or a profile itself (the collector, `dlo.agent.collector`,
and the node agent, `dlo.agent.node`, do), run a host read on the event loop, or let one failing
request take the server down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from dlo.agent.collector import make_registry
from dlo.agent.node import Agent

log = logging.getLogger(__name__)

BACKLOG = 128
WORKERS = 2  # /metrics and /profile at once; a third waits for one of them
START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the agent's server."""

    max_connections: int = 256
    per_address: int = 32
    head_timeout_s: float = 5.0


_REFUSAL = json.dumps({"error": "too many connections; retry shortly"}).encode()


class _CappedServer(web.Server):
    """aiohttp's low-level server with the connection caps of `Limits`."""

    def __init__(self, handler: Any, limits: Limits, **kwargs: Any):
        super().__init__(handler, keepalive_timeout=limits.head_timeout_s, lingering_time=1.0, **kwargs)
        self.limits = limits
        self.refused_total = 0
        self._per_address: Counter[str] = Counter()
        self._address_of: dict[Any, str] = {}

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(handler, transport)
        address = (transport.get_extra_info("peername") or ("?",))[0]
        if len(self._address_of) >= self.limits.max_connections or \
                self._per_address[address] >= self.limits.per_address:
            # after aiohttp's handler has started (closing inside connection_made races its start)
            self._loop.call_soon(self._refuse, transport, address)
            return
        self._per_address[address] += 1
        self._address_of[handler] = address

    def _refuse(self, transport: asyncio.Transport, address: str) -> None:
        if self.refused_total % 1000 == 0:
            log.warning("agent http: refusing connections over the cap max_connections=%d per_address=%d "
                        "address=%s refused_total=%d", self.limits.max_connections, self.limits.per_address,
                        address, self.refused_total + 1)
        self.refused_total += 1
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL)).encode() + b"\r\n\r\n" +
                        _REFUSAL)
        transport.close()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:  # type: ignore[override]
        address = self._address_of.pop(handler, None)
        if address is not None:
            self._per_address[address] -= 1
            if self._per_address[address] <= 0:
                del self._per_address[address]
        super().connection_lost(handler, exc)


def _routes(agent: Agent, registry: CollectorRegistry) -> dict[str, Callable[[], tuple[int, str, bytes]]]:
    return {
        "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(registry)),
        "/profile": lambda: (
            200, "application/json", agent.profile().model_dump_json(indent=1, exclude_none=True).encode()
        ),
    }


def _json(code: int, error: str) -> web.Response:
    return web.Response(status=code, body=json.dumps({"error": error}).encode(), content_type="application/json")


class AgentServer:
    """The running server: `server_address` (host, port) and `shutdown()`."""

    def __init__(self, agent: Agent, host: str, port: int, limits: Limits):
        self.limits = limits
        self._routes = _routes(agent, make_registry(agent))
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="dlo-agent-route")
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.ServerRunner | None = None
        self.server_address: tuple[str, int] = (host, port)
        self._thread = threading.Thread(target=self._run, args=(host, port), name="dlo-agent-http", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise OSError(f"the agent's HTTP server did not start within {START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise self._error

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path == "/health":
            return web.Response(text="ok\n", content_type="text/plain") if request.method in ("GET", "HEAD") \
                else _json(405, f"method {request.method} is not allowed on {path}")
        route = self._routes.get(path)
        if route is None:
            return _json(404, f"no route {path}")
        if request.method not in ("GET", "HEAD"):
            return _json(405, f"method {request.method} is not allowed on {path}")
        try:
            code, ctype, body = await self._loop.run_in_executor(self._pool, route)
        except Exception as e:  # one failing source must not take the server down
            log.exception("request failed path=%s", path)
            return _json(500, str(e))
        response = web.Response(status=code, body=body)
        response.headers["Content-Type"] = ctype
        return response

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(host, port))
        except BaseException as e:  # a port in use, say: handed to the caller
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    async def _start(self, host: str, port: int) -> None:
        server = _CappedServer(self._handle, self.limits, loop=self._loop)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=BACKLOG, reuse_address=True)
        await site.start()
        if self._runner.addresses:
            self.server_address = tuple(self._runner.addresses[0][:2])  # type: ignore[assignment]

    def shutdown(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)


def serve(agent: Agent, host: str, port: int, limits: Limits | None = None) -> AgentServer:
    """Start the HTTP server on a daemon thread and return it (`.shutdown()` to stop)."""
    server = AgentServer(agent, host, port, limits or Limits())
    lim = server.limits
    log.info("agent listening host=%s port=%d max_connections=%d per_address=%d head_timeout_seconds=%g backlog=%d",
             host, server.server_address[1], lim.max_connections, lim.per_address, lim.head_timeout_s, BACKLOG)
    return server
