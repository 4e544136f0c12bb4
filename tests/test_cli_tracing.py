"""cli/tracing.py: traces only where the standard OTEL_* variables ask for them; off, nothing of the
SDK is imported and no provider is set; an exporter that is not installed is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dlo.cli.tracing import TracingError, exporter_names

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


@pytest.mark.parametrize("environ, names", [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, []),  # no exporter asked for
    (ENDPOINT, ["otlp_proto_http"]),  # the specification's default protocol
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp_proto_http", "console"]),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, []),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, []),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp_proto_grpc"]),
])
def test_exporters_come_from_the_standard_variables(environ, names):
    assert exporter_names(environ) == names


def test_an_unknown_protocol_names_the_variable():
    with pytest.raises(TracingError, match="OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json'"):
        exporter_names({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


PROBE = """
import sys
from opentelemetry import trace
from dlo.cli.tracing import enabled, start_tracing
print(start_tracing("probe"), enabled(), type(trace.get_tracer_provider()).__name__,
      "opentelemetry.sdk" in sys.modules)
"""


def test_without_the_variables_no_provider_is_set_and_the_sdk_is_never_imported():
    assert _python(PROBE, {"OTEL_SERVICE_NAME": "x"}).stdout.split() == ["False", "False", "ProxyTracerProvider",
                                                                         "False"]
    assert _python(PROBE, ENDPOINT).stdout.split() == ["True", "True", "TracerProvider", "True"]


@pytest.mark.parametrize("argv", [["serve", "/nonexistent-model"], ["operator", "run"]])
def test_an_exporter_not_installed_is_one_line_and_exit_2(argv):
    proc = subprocess.run([sys.executable, "-m", "dlo.cli.main", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OTEL_TRACES_EXPORTER": "zipkin_json"})
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "OTEL_TRACES_EXPORTER: no trace exporter 'zipkin_json' is installed (installed: console," in line
    assert "Traceback" not in proc.stderr
