"""ASGI middleware of `dlo serve`: who may call (the API key), and what every answer is counted as.

Owns: `Accounting` - with a key, `/v1/*` and the API's own description (`/docs`, `/redoc`,
`/openapi.json`) need `Authorization: Bearer KEY`, compared in constant time; a request with more
than one Authorization header is refused (400), never decided by whichever comes first; `/health`,
`/ready` and `/metrics` are open (probes and Prometheus carry no key). Every answer is counted in
`dlo_requests_total{endpoint, method, code}` (the route template; 499 when the client left before
its answer), and a POST whose answer is its result (an image) is timed in
`dlo_request_duration_seconds`; the creation of a video job is not (it returns at once: the job is
timed by `dlo_video_job_duration_seconds`).
Must never: compare keys in variable time, label a metric by request (ids, paths with ids), or read
a request's body.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any, Callable

from starlette.routing import Match

from dlo.serving.metrics import EngineMetrics

DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
UNTIMED = ("/v1/videos",)  # answered at once; the job is timed from creation to completion
CLIENT_CLOSED = 499  # nginx's "client closed request": the answer was never read


def digest(key: bytes) -> bytes:
    """Keys are compared as digests: equal length, so the comparison time says nothing about the key."""
    return hashlib.sha256(key).digest()


def _json(status: int, message: str, code: str) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, {"type": "http.response.body", "body": body}


class Accounting:
    """`app.add_middleware(Accounting, metrics=..., api_key=..., routes=app.routes)`."""

    def __init__(self, app: Any, metrics: EngineMetrics, api_key: str | None, routes: list):
        self.app, self.metrics, self.routes = app, metrics, routes
        self.expected = digest(api_key.encode()) if api_key else None

    def _endpoint(self, scope: dict) -> str:
        """The route template (low cardinality), also for requests answered before routing (401)."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", None) or "unmatched"

    def _refusal(self, scope: dict) -> tuple[dict, dict] | None:
        path = scope["path"]
        if self.expected is None or not (path.startswith("/v1/") or path in DOC_PATHS):
            return None
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1:
            return _json(400, "more than one Authorization header; send one: Authorization: Bearer KEY",
                         "invalid_request")
        header = given[0] if given else b""
        key = header[7:] if header[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(digest(key), self.expected):
            return _json(401, "invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")
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

        refusal = self._refusal(scope)
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
        self.metrics.requests.labels(endpoint, method, str(status)).inc()
        if method == "POST" and endpoint not in UNTIMED and status != CLIENT_CLOSED:
            self.metrics.request_duration.labels(endpoint).observe(seconds)
