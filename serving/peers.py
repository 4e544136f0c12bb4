"""Forwarding a video request to the pod whose job it is (replicas > 1 behind one client Service).

A job id names its pod (`video_<pod>_<hex>`, `dlo.serving.videos`); the client Service may
send a poll, a download or a delete to any pod. The pod that gets it asks the job's pod through
the headless Service (`http://<pod>.<headless>.<namespace>.svc:<port>`, from the URL template the
operator sets in `DLO_PEER_URL_TEMPLATE`) with the caller's Authorization header, and answers what
that pod answered. A pod that does not answer in time is a 504, one that cannot be reached a 502,
both in OpenAI's error shape. A forwarded request carries `X-DLO-Forwarded`, and is never forwarded
again (no loops, whatever the ids say).
`DLO_PEER_URLS` (a JSON object pod -> base URL) overrides the template: for tests and for setups
outside Kubernetes; the operator never sets it.
Owns: where a pod is reached, and the forwarding itself (HTTP only).
Must never: forward to a host that the template or the map does not name, or forward without the
caller's own credentials (it adds none of its own).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-dlo-forwarded"
PEER_URL_TEMPLATE_ENV = "DLO_PEER_URL_TEMPLATE"
PEER_URLS_ENV = "DLO_PEER_URLS"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
_PASSED_BACK = ("content-type", "content-length", "retry-after", "allow")
_CHUNK = 1 << 16


class PeerError(Exception):
    """The job's pod could not answer: `status` is 502 (unreachable) or 504 (timed out)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Peers:
    """Where the other pods of this deployment answer, and a client to ask them."""

    def __init__(self, template: str | None = None, urls: dict[str, str] | None = None, *,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S):
        if template is not None and "{pod}" not in template:
            raise ValueError(f"{PEER_URL_TEMPLATE_ENV} must contain {{pod}}, got {template!r}")
        import aiohttp  # here, not at the module's import: a server without peers never loads it (~0.3 s)

        self.template, self.urls = template, dict(urls or {})
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s,
                                             sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ) -> "Peers | None":
        """From `DLO_PEER_URL_TEMPLATE` / `DLO_PEER_URLS`; None when neither is set (no forwarding)."""
        template = env.get(PEER_URL_TEMPLATE_ENV) or None
        raw = env.get(PEER_URLS_ENV) or None
        urls: dict[str, str] | None = None
        if raw is not None:
            urls = json.loads(raw)
            if not isinstance(urls, dict) or not all(isinstance(v, str) for v in urls.values()):
                raise ValueError(f"{PEER_URLS_ENV} must be a JSON object of pod name -> base URL")
        if template is None and not urls:
            return None
        return cls(template, urls)

    def url(self, pod: str) -> str | None:
        if pod in self.urls:
            return self.urls[pod].rstrip("/")
        return self.template.format(pod=pod).rstrip("/") if self.template else None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: Request, pod: str) -> Response:
        """Send `request` (method, path, query, Authorization) to `pod` and answer what it answered;
        bodies (an MP4 too) stream through without being held whole."""
        import aiohttp

        base = self.url(pod)
        assert base is not None, "the caller checks url() first"
        target = base + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {FORWARDED_HEADER: "1"}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)
        try:
            resp = await self._session.request(request.method, target, headers=headers, allow_redirects=False)
        except asyncio.TimeoutError:
            raise PeerError(504, "upstream_timeout", f"pod {pod} did not answer in time (connect "
                            f"{self.timeout.sock_connect:g} s, read {self.timeout.sock_read:g} s)") from None
        except aiohttp.ClientError as e:
            raise PeerError(502, "upstream_unreachable", f"pod {pod} could not be reached: {e}") from None
        passed = {k: v for k, v in resp.headers.items() if k.lower() in _PASSED_BACK}
        if resp.headers.get("content-type", "").startswith("application/json"):
            try:  # small: read whole, so that a stall is a clean 504 rather than a cut-off body
                body = await resp.read()
            except asyncio.TimeoutError:
                raise PeerError(504, "upstream_timeout", f"pod {pod} stopped answering") from None
            except aiohttp.ClientError as e:
                raise PeerError(502, "upstream_unreachable", f"pod {pod} broke off its answer: {e}") from None
            finally:
                resp.release()
            passed.pop("content-length", None)
            return Response(body, status_code=resp.status, headers=passed)

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    yield chunk
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                # the status line is out: all that is left is to cut the body short (the length says so)
                log.warning("forwarding from pod %s broke off: %s", pod, e)
                raise
            finally:
                resp.release()

        return StreamingResponse(stream(), status_code=resp.status, headers=passed)
