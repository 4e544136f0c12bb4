"""The node agent's HTTP server: `/metrics`, `/profile` and `/health`.

Owns: the routes, their content types and status codes (404 for an unknown path, 500 with a JSON
error when a route fails), and the server thread (`serve`).
Must never: import torch, compute a metric or a profile itself (the collector, `dlo.agent.collector`,
and the node agent, `dlo.agent.node`, do), or let one failing request take the server down.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest

from dlo.agent.collector import make_registry
from dlo.agent.node import Agent

log = logging.getLogger(__name__)


def make_handler(agent: Agent, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(registry)),
        "/profile": lambda: (
            200, "application/json", agent.profile().model_dump_json(indent=1, exclude_none=True).encode()
        ),
        "/health": lambda: (200, "text/plain", b"ok\n"),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                code, ctype, body = 404, "application/json", json.dumps({"error": f"no route {self.path}"}).encode()
            else:
                try:
                    code, ctype, body = route()
                except Exception as e:  # one failing source must not take the server down
                    log.exception("request failed path=%s", self.path)
                    code, ctype, body = 500, "application/json", json.dumps({"error": str(e)}).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http " + format, *args)

    return Handler


def serve(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    """Start the HTTP server in a daemon thread and return it (`.shutdown()` to stop)."""
    server = ThreadingHTTPServer((host, port), make_handler(agent, make_registry(agent)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="dlo-agent-http", daemon=True).start()
    log.info("agent listening host=%s port=%d", host, server.server_address[1])
    return server
