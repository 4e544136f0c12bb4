"""A small OTLP/HTTP trace receiver for the tests (not a test module): a real HTTP server on
loopback that decodes each `ExportTraceServiceRequest` (opentelemetry-proto) the exporters of the
processes under test send to `/v1/traces`, and keeps the spans."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    status: int = 0  # 0 unset, 1 ok, 2 error
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                  str(resource.get("service.name", "")), {a.key: _value(a.value) for a in s.attributes},
                                  s.status.code, s.start_time_unix_nano, s.end_time_unix_nano))
    return spans


class OtlpReceiver:
    """`with OtlpReceiver() as r:` then `r.endpoint` (OTEL_EXPORTER_OTLP_ENDPOINT) and `r.spans()`."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    receiver._add(decode(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _add(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans += spans
            self.requests += 1

    def spans(self, name: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if name is None or s.name == name]

    def env(self, service: str | None = None) -> dict[str, str]:
        """The standard variables that send a process's spans here, exported every 100 ms."""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        if service:
            env["OTEL_SERVICE_NAME"] = service
        return env

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
