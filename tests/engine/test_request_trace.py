"""Traces and JSON logs of a real `dlo serve` (serving/request_trace.py, serving/phase_marks.py,
cli/tracing.py, cli/logs.py): two ranks in two processes, the standard OTEL_* variables pointing at a
real OTLP/HTTP receiver, two image requests in one wave, each continuing its caller's trace."""

from __future__ import annotations

import json

import pytest
import requests

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import submit_in_order, tiny_pipeline, wait_until
from tests.otlp_receiver import OtlpReceiver, Span

pytestmark = pytest.mark.slow

HTTP = "POST /v1/images/generations"
PHASES = ("dlo.prepare", "dlo.denoise", "dlo.decode", "dlo.encode_output")
EVERY = {HTTP, "dlo.queue", "dlo.wave", "dlo.text_encode", *PHASES}
CALLERS = {"a red bicycle": ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),
           "a blue boat": ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")}


def _trace(otlp: OtlpReceiver, trace_id: str) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in otlp.spans():
        if s.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def _request(url: str, prompt: str) -> requests.Response:
    trace_id, parent = CALLERS[prompt]
    return requests.post(url + "/v1/images/generations", json={"prompt": prompt, "size": "32x32"},
                         headers={"traceparent": f"00-{trace_id}-{parent}-01"}, timeout=120)


def _assert_one_request_tree(spans: dict[str, list[Span]], caller: str) -> None:
    (http,) = spans[HTTP]
    assert http.parent_id == caller and http.service == "dlo-serve"
    (queue,), (wave,) = spans["dlo.queue"], spans["dlo.wave"]
    assert queue.parent_id == http.span_id and wave.parent_id == http.span_id
    assert queue.end_ns <= wave.start_ns and wave.end_ns <= http.end_ns
    assert (wave.attributes["dlo.wave.size"], wave.attributes["dlo.request.kind"]) == (2, "image")
    phases = [spans[name][0] for name in PHASES]
    assert all(p.parent_id == wave.span_id for p in phases)
    assert [p.start_ns for p in phases] == sorted(p.start_ns for p in phases)
    assert wave.start_ns <= phases[0].start_ns and phases[-1].end_ns <= wave.end_ns
    # the prompt and the negative prompt (CFG), each one text encoder forward inside the prepare phase
    assert [t.parent_id for t in spans["dlo.text_encode"]] == [phases[0].span_id] * 2


def test_two_requests_of_one_wave_are_two_traces_of_their_phases_and_every_log_line_is_json(tmp_path_factory,
                                                                                            tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    log = tmp_path / "serve.log"
    with OtlpReceiver() as otlp:
        with ServerProcess(model, "--dp", "2", "--mode", "rank-local", "--device", "cpu", "--small-limits",
                           "--wave-window-ms", "5000", "--log-format", "json", env=otlp.env(), log_path=log) as srv:
            answers = submit_in_order(srv.url, [lambda p=p: _request(srv.url, p) for p in CALLERS])
            assert [r.status_code for r in answers] == [200, 200]
            for trace_id, _ in CALLERS.values():
                wait_until(lambda t=trace_id: EVERY <= set(_trace(otlp, t)), 30, f"trace {trace_id} is exported")
        assert srv.proc is not None and srv.proc.returncode == 0
    for trace_id, caller in CALLERS.values():
        _assert_one_request_tree(_trace(otlp, trace_id), caller)
    waves = otlp.spans("dlo.wave")
    assert len({w.attributes["dlo.wave.number"] for w in waves}) == 1  # one wave, one span per request in it
    assert not [s for s in otlp.spans() if "/ready" in s.name or "/health" in s.name]  # probes make no spans

    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line is one JSON object
    assert all({"timestamp", "severity", "logger", "message", "rank"} <= r.keys() for r in records)
    assert {r["rank"] for r in records} == {0, 1}  # rank 1 is a process of its own, logging JSON too
    assert any(r["logger"] == "dlo.serving.service" and r["message"].startswith("wave 1 size=2") for r in records)
    # uvicorn's records go through our handler; one made inside a request's span names its trace
    answered = [r for r in records if r["logger"] == "uvicorn.access" and HTTP in r["message"]]
    assert sorted(r.get("trace_id") for r in answered) == sorted(t for t, _ in CALLERS.values())
