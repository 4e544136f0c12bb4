"""OpenTelemetry traces of a `dlo` process, opt-in by the standard `OTEL_*` variables.

Owns: `start_tracing(service)`: a tracer provider exporting in batches, set only when
`OTEL_TRACES_EXPORTER` names an exporter, or `OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (then `otlp`); `none`, `OTEL_SDK_DISABLED=true` or
none of them: nothing is imported of the SDK, no provider is set, the API's tracers stay no-ops.
`otlp` is OTLP over HTTP/protobuf, the protocol the specification defaults to and the one our
images ship (`OTEL_EXPORTER_OTLP_PROTOCOL=grpc` takes the gRPC exporter where it is installed);
any other name is the trace exporter of that name the installed packages declare (`console`).
`enabled()` says whether a provider was set, `flush(seconds)` exports what is buffered, bounded.
While tracing, each log record made inside a span carries its `trace_id` and `span_id` (`TraceIds`,
on the root logger's handlers: `configure_logging` comes first), which JSON logs show.
The rest is the SDK's own reading of the standard variables: endpoint, headers, timeout and
compression (the exporter), `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the resource; the
process's name, e.g. `dlo-serve`, where neither names a service), `OTEL_TRACES_SAMPLER` (the
provider), `OTEL_BSP_*` (the batch processor).
Must never: import the SDK when tracing is off, or read a variable the SDK reads itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

EXPORTER_GROUP = "opentelemetry_traces_exporter"  # the entry points exporters are declared under
OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}

_provider: Any = None


class TracingError(ValueError):
    """The OTEL_* variables ask for what cannot run: the message names the variable."""


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The trace exporters the environment asks for ([]: tracing off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return [] if names == ["none"] else [_entry_point_name(n, environ) for n in names]


def _entry_point_name(name: str, environ: Mapping[str, str]) -> str:
    if name != "otlp":
        return name
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    if protocol not in OTLP_BY_PROTOCOL:
        raise TracingError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not a protocol of this build "
                           f"({', '.join(OTLP_BY_PROTOCOL)})")
    return OTLP_BY_PROTOCOL[protocol]


def _exporter(name: str) -> Any:
    from importlib.metadata import entry_points

    found = list(entry_points(group=EXPORTER_GROUP, name=name))
    if not found:
        known = sorted(e.name for e in entry_points(group=EXPORTER_GROUP))
        raise TracingError(f"OTEL_TRACES_EXPORTER: no trace exporter {name!r} is installed "
                           f"(installed: {', '.join(known) or 'none'})")
    return found[0].load()()


def start_tracing(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Set the global tracer provider when the environment asks for traces; True when it did.
    Raises `TracingError` (one line naming the variable) for an exporter or protocol not installed."""
    global _provider
    names = exporter_names(os.environ if environ is None else environ)
    if not names or _provider is not None:
        return _provider is not None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(n) for n in names]
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIds())
    return True


class TraceIds(logging.Filter):
    """`trace_id` and `span_id` (hex, as OTLP backends show them) on a record made inside a span."""

    def filter(self, record: logging.LogRecord) -> bool:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id, record.span_id = f"{context.trace_id:032x}", f"{context.span_id:016x}"
        return True


def enabled() -> bool:
    return _provider is not None


def flush(seconds: float = 5.0) -> None:
    """Export the spans still buffered, waiting at most `seconds` (a process about to `os._exit`)."""
    if _provider is not None:
        _provider.force_flush(int(seconds * 1000))
