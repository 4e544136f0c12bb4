"""Traces of the requests rank 0 serves (OpenTelemetry), made only while `dlo.cli.tracing` is on.

Owns: the HTTP server span of each API request (`instrument_http`: OpenTelemetry's FastAPI
instrumentation, which also continues a caller's `traceparent`; `/health`, `/ready` and `/metrics`
left out unless `OTEL_PYTHON_FASTAPI_EXCLUDED_URLS` says otherwise), the context a request is queued
in (`request_context`, the default of `Pending.trace`), and the spans of its wave, children of the
HTTP span (`start_wave_spans`, when its wave is taken from the queue): `dlo.queue` (queued until the
wave starts) and `dlo.wave` (until its result or error reaches rank 0), and under the wave the
request's phases as its rank's `PhaseClock` timed them (`Result.timeline`): `dlo.prepare`,
`dlo.denoise`, `dlo.decode`, `dlo.encode_output`, with `dlo.text_encode` inside `dlo.prepare`. The
ranks run in processes of their own and make no spans: their wall-clock intervals become spans here.
Must never: cost anything while tracing is off (no context kept, no span made, no middleware), or
run on a rank.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Sequence

from dlo.cli import tracing

TRACER = "dlo.serving"
PHASES = ("prepare", "denoise", "decode", "encode_output")  # `PhaseClock` phases; any other name is a mark
PROBES = "/health$,/ready$,/metrics$"  # regexes (OpenTelemetry's excluded-URL list)
EXCLUDED_URLS_ENV = ("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS", "OTEL_PYTHON_EXCLUDED_URLS")


def instrument_http(app: Any) -> None:
    """A server span per HTTP request of `app` (FastAPI), when tracing is on."""
    if not tracing.enabled():
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    excluded = None if any(os.environ.get(v) for v in EXCLUDED_URLS_ENV) else PROBES
    FastAPIInstrumentor.instrument_app(app, excluded_urls=excluded, exclude_spans=["receive", "send"])


def request_context() -> Any:
    """The current OpenTelemetry context (the HTTP request's span) while tracing is on, else None."""
    if not tracing.enabled():
        return None
    from opentelemetry import context

    return context.get_current()


def start_wave_spans(wave: Sequence[Any], number: int) -> None:
    """A wave of `waves.Pending` starts: each traced request's `dlo.queue` span ends, its `dlo.wave`
    span starts and ends (with its phases) when the request's future is resolved."""
    traced = [p for p in wave if p.trace is not None and p.future is not None]
    if not traced:
        return
    from opentelemetry import trace

    tracer = trace.get_tracer(TRACER)
    now_ns = time.time_ns()
    monotonic_to_wall = now_ns - time.monotonic_ns()
    for p in traced:
        queued_ns = int(p.enqueued * 1e9) + monotonic_to_wall
        tracer.start_span("dlo.queue", context=p.trace, start_time=queued_ns).end(end_time=now_ns)
        span = tracer.start_span("dlo.wave", context=p.trace, start_time=now_ns,
                                 attributes=_attributes(p, number, len(wave)))
        assert p.future is not None
        p.future.add_done_callback(functools.partial(_end_wave, tracer, span))


def _attributes(p: Any, number: int, size: int) -> dict[str, Any]:
    gen = p.gen
    out = {"dlo.wave.number": number, "dlo.wave.size": size, "dlo.request.kind": gen.kind,
           "dlo.request.width": gen.width, "dlo.request.height": gen.height, "dlo.request.steps": gen.steps,
           "dlo.request.n": gen.n, "dlo.request.frames": gen.frames}
    if p.request_id:
        out["dlo.request.id"] = p.request_id
    if gen.lora_id:
        out["dlo.request.lora"] = gen.lora_id
    return out


def _end_wave(tracer: Any, span: Any, future: Any) -> None:
    from opentelemetry.trace import Status, StatusCode

    if future.cancelled():  # its client left: the wave runs on without it
        span.set_attribute("dlo.request.withdrawn", True)
    elif future.exception() is not None:
        span.set_status(Status(StatusCode.ERROR, str(future.exception())))
    else:
        phase_spans(tracer, span, future.result().timeline)
    span.end()


def phase_spans(tracer: Any, wave_span: Any, timeline: Sequence[tuple[str, int, int]]) -> None:
    """The spans of a request's phases under `wave_span`, and of each mark under the phase that
    holds it (else under the wave)."""
    from opentelemetry import trace

    phases = []
    for name, start, end in timeline:
        if name in PHASES:
            span = tracer.start_span(f"dlo.{name}", context=trace.set_span_in_context(wave_span), start_time=start)
            span.end(end_time=end)
            phases.append((start, end, span))
    for name, start, end in timeline:
        if name not in PHASES:
            parent = next((s for s0, s1, s in phases if s0 <= start and end <= s1), wave_span)
            tracer.start_span(f"dlo.{name}", context=trace.set_span_in_context(parent),
                              start_time=start).end(end_time=end)
