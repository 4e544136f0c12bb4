"""The operator's own Prometheus metrics, served at `/metrics` on `--metrics-port` (default 8081).

Owns: one registry (not the process default, so nothing else in the process leaks into it) with
- `dlo_operator_reconciles_total{result}`: reconciles by result (`success`, `invalid_spec`,
  `api_error`, `error`);
- `dlo_operator_reconcile_duration_seconds`: wall time of one reconcile;
- `dlo_operator_dlodeployments{condition, status}`: DLODeployments by condition type and status,
  from the conditions the operator last wrote for each (forgotten when the resource is deleted);
- `dlo_operator_api_errors_total{code}`: API requests answered with an error (HTTP code; a 404 is
  an answer, not an error) or not answered at all (`code="none"`).
Must never: talk to the API server or decide anything; handlers and the client report into it.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

METRICS_PORT = 8081  # 8080 is kopf's liveness endpoint; dlo.operator.cli repeats it (no import at parse time)
METRICS_PORT_ENV = "DLO_OPERATOR_METRICS_PORT"
RESULTS = ("success", "invalid_spec", "api_error", "error")
CONDITION_STATUSES = ("True", "False", "Unknown")

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "dlo_operator_reconciles_total", "Reconciles of DLODeployments by result", ["result"], registry=REGISTRY
)
RECONCILE_SECONDS = Histogram(
    "dlo_operator_reconcile_duration_seconds",
    "Wall time of one reconcile of a DLODeployment",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
API_ERRORS = Counter(
    "dlo_operator_api_errors_total",
    "Kubernetes API requests of the operator answered with an error (code) or not answered (code none)",
    ["code"],
    registry=REGISTRY,
)
for _result in RESULTS:
    RECONCILES.labels(_result)  # every series exists from the start: rate() sees the first one


class _ConditionCollector(Collector):
    """`dlo_operator_dlodeployments{condition, status}` from the last conditions of each resource."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_resource: dict[tuple[str, str], dict[str, str]] = {}

    def observe(self, namespace: str, name: str, conditions: list[dict[str, Any]]) -> None:
        with self._lock:
            self._by_resource[(namespace, name)] = {c["type"]: c["status"] for c in conditions if "type" in c}

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._by_resource.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            tally = Tally((t, s) for conds in self._by_resource.values() for t, s in conds.items())
        family = GaugeMetricFamily(
            "dlo_operator_dlodeployments", "DLODeployments by condition type and status", labels=["condition", "status"]
        )
        from dlo.operator.status import CONDITION_TYPES

        for condition in CONDITION_TYPES:
            for status in CONDITION_STATUSES:
                family.add_metric([condition, status], tally.get((condition, status), 0))
        yield family


CONDITIONS = _ConditionCollector()
REGISTRY.register(CONDITIONS)


def serve(port: int, address: str = "0.0.0.0") -> Any:
    """Serve REGISTRY at http://ADDRESS:PORT/metrics in a daemon thread; returns the server."""
    server, _thread = start_http_server(port, address, registry=REGISTRY)
    return server
