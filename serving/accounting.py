"""ASGI middleware of `dlo serve`: who calls (the API key, its tenant), and what every answer is counted as.

Owns: `Accounting` - with keys, `/v1/*` and the API's own description (`/docs`, `/redoc`,
`/openapi.json`) need `Authorization: Bearer KEY` of one of the server's keys (`Tenants.identify`:
constant time); a request with more than one Authorization header is refused (400), never decided
by whichever comes first; `/health`, `/ready` and `/metrics` are open (probes and Prometheus carry no
key). Every request gets its `Caller` (`dlo.serving.tenants`: its tenant, what it sees, whom the
quotas count it against) in its scope's state (`request.state.caller`). Every answer is counted in
`dlo_requests_total{endpoint, method, code, tenant}` (the route template; 499 when the client left
before its answer; `tenant` is the key's name, empty for a request without one), and a POST whose
answer is its result (an image) is timed in `dlo_request_duration_seconds{endpoint, tenant}`; the
creation of a video job is not (it returns at once: the job is timed by
`dlo_video_job_duration_seconds`).
Must never: compare keys in variable time, label a metric by request (ids, paths with ids) or by
anything but a tenant's name (never the key), or read a request's body.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from starlette.routing import Match

from dlo.serving.metrics import EngineMetrics
from dlo.serving.tenants import Tenants

DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
UNTIMED = ("/v1/videos",)  # answered at once; the job is timed from creation to completion
CLIENT_CLOSED = 499  # nginx's "client closed request": the answer was never read


def _json(status: int, message: str, code: str) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, {"type": "http.response.body", "body": body}


class Accounting:
    """`app.add_middleware(Accounting, metrics=..., tenants=..., routes=app.routes)`."""

    def __init__(self, app: Any, metrics: EngineMetrics, tenants: Tenants, routes: list):
        self.app, self.metrics, self.tenants, self.routes = app, metrics, tenants, routes

    def _endpoint(self, scope: dict) -> str:
        """The route template (low cardinality), also for requests answered before routing (401)."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", None) or "unmatched"

    def _admit(self, scope: dict) -> tuple[dict, dict] | None:
        """The refusal of a request that needs a key and has none of ours; else None, with its
        `Caller` in the scope's state where it has one (a request to the API, or any without keys)."""
        path, client = scope["path"], scope.get("client")
        address = client[0] if client else None
        if not self.tenants.required:
            scope.setdefault("state", {})["caller"] = self.tenants.caller(None, address)
            return None
        if not (path.startswith("/v1/") or path in DOC_PATHS):
            return None
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:
            return _json(400, "more than one Authorization header; send one: Authorization: Bearer KEY",
                         "invalid_request")
        header = given[0] if given else b""
        tenant = self.tenants.identify(header[7:] if header[:7].lower() == b"bearer " else b"")
        if tenant is None:
            return _json(401, "invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")
        scope.setdefault("state", {})["caller"] = self.tenants.caller(tenant, address)
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        refusal = self._admit(scope)
        try:
            if refusal is not None:
                for message in refusal:
                    await counted(message)
            else:
                await self.app(scope, receive, counted)
        finally:
            self._count(scope, status, time.perf_counter() - t0)

    def _count(self, scope: dict, status: int, seconds: float) -> None:
        endpoint, method = self._endpoint(scope), scope["method"]
        caller = scope.get("state", {}).get("caller")
        tenant = (caller.tenant or "") if caller is not None else ""
        self.metrics.requests.labels(endpoint, method, str(status), tenant).inc()
        if method == "POST" and endpoint not in UNTIMED and status != CLIENT_CLOSED:
            self.metrics.request_duration.labels(endpoint, tenant).observe(seconds)
