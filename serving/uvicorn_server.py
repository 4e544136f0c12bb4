"""`dlo serve`'s HTTP server: uvicorn with our connection protocol, limits and drain on a signal.

Owns: `http_server` (the uvicorn server for the app, its connection guard and limits from the
flags) and its `Server` class (SIGTERM/SIGINT drain the engine first).
Must never: let uvicorn's own graceful shutdown cancel a handler the engine's drain still lets finish.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

from dlo.serving.config import ApiConfig

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # uvicorn's default


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


def http_server(api: ApiConfig, engine: Any, app: Any) -> Any:
    """uvicorn with our connection protocol and limits."""
    import uvicorn

    from dlo.serving.connections import (
        FD_RESERVE,
        LOOPBACK,
        ConnectionGuard,
        ConnectionLimits,
        default_max_connections,
        raise_nofile_limit,
    )
    from dlo.serving.http_protocol import guarded_protocol

    nofile = raise_nofile_limit()
    max_connections = api.max_connections or default_max_connections(nofile)
    if max_connections > nofile - FD_RESERVE:
        log.warning("--max-connections %d leaves fewer than %d of RLIMIT_NOFILE %d for the engine: accepts may "
                    "fail for lack of descriptors", max_connections, FD_RESERVE, nofile)
    guard = ConnectionGuard(ConnectionLimits(
        max_connections, idle_timeout_s=api.idle_timeout, body_timeout_s=api.body_timeout,
        min_body_rate=api.min_body_rate, probe_networks=(*LOOPBACK, *api.probe_cidr)))
    # uvicorn's graceful timeout only guards a stop that did not come through the drain: above the
    # grace, so it never cancels a handler the drain still lets finish.
    server = _server_class(engine, guard)(uvicorn.Config(
        app, log_level=api.log_level, http=guarded_protocol(guard), backlog=LISTEN_BACKLOG,
        log_config=None if api.log_format == "json" else uvicorn.config.LOGGING_CONFIG,  # JSON: through our handler
        timeout_keep_alive=max(1, int(api.idle_timeout)),
        timeout_graceful_shutdown=int(api.shutdown_grace) + 5))
    engine.request_exit = lambda: setattr(server, "should_exit", True)
    return server
