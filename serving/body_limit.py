"""ASGI middleware: a request body over the limit gets 413 before any of it is parsed.

Owns: `BodyLimit` (the 413 in OpenAI's error shape; counted, as every answer, by `accounting.Accounting`).
Must never: hold more than the limit of any one request body in memory, or read a byte of a body
whose declared length is already over the limit.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from dlo.serving.api_models import ApiError


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before any of it is parsed.

    A declared Content-Length over the limit is refused without reading a byte of the body. Any
    other body (chunked included) is read here, counted as it arrives, refused the moment it passes
    the limit, and otherwise handed on unchanged: no request holds more than the limit in memory.
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left mid-body: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(send)
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Callable) -> None:
        err = ApiError(413, f"the request body exceeds this server's limit of {self.max_bytes} bytes",
                       code="body_too_large")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
