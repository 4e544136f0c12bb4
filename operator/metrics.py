"""The operator's own Prometheus metrics, served at `/metrics` on `--metrics-port` (default 8081).

Owns: one registry (not the process default, so nothing else in the process leaks into it) with
- `dlo_operator_reconciles_total{result}`: reconciles by result (`success`, `invalid_spec`,
  `api_error`, `error`);
- `dlo_operator_reconcile_duration_seconds`: wall time of one reconcile;
- `dlo_operator_dlodeployments{condition, status}`: DLODeployments by condition type and status,
  from the conditions the operator last wrote for each (forgotten when the resource is deleted);
- `dlo_operator_dlodeployment_condition{namespace, deployment, condition, status, reason}`: 1 for
  each condition of each DLODeployment as last written (what the Degraded and FetchFailed alerts
  select; the chart's ServiceMonitor keeps these labels: honorLabels);
- `dlo_operator_leading`: 1 while this replica holds the lease (leader election) and reconciles;
- `dlo_operator_api_errors_total{code}`: API requests answered with an error (HTTP code; a 404 is
  an answer, not an error) or not answered at all (`code="none"`);
- `dlo_model_fetch_state{model, state}`: nodes per fetched model (its cache key) and fetch state
  (complete, fetching, pending, failed), over every DLODeployment with that `model.uri`;
- `dlo_model_fetch_bytes_total{model}`: bytes the fetch Jobs moved onto nodes (progress as the
  operator reads it, completed by each finished fetch's own count).
Must never: talk to the API server or decide anything; handlers and the client report into it.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
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
LEADING = Gauge("dlo_operator_leading", "1 while this operator replica holds the lease and reconciles, else 0",
                registry=REGISTRY)
for _result in RESULTS:
    RECONCILES.labels(_result)  # every series exists from the start: rate() sees the first one


class _ConditionCollector(Collector):
    """`dlo_operator_dlodeployments{condition, status}` and `dlo_operator_dlodeployment_condition`
    from the last conditions of each resource."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_resource: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}

    def observe(self, namespace: str, name: str, conditions: list[dict[str, Any]]) -> None:
        with self._lock:
            self._by_resource[(namespace, name)] = {c["type"]: (c["status"], c.get("reason", ""))
                                                    for c in conditions if "type" in c}

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._by_resource.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            resources = {key: dict(conds) for key, conds in self._by_resource.items()}
        tally = Tally((t, s) for conds in resources.values() for t, (s, _) in conds.items())
        family = GaugeMetricFamily(
            "dlo_operator_dlodeployments", "DLODeployments by condition type and status", labels=["condition", "status"]
        )
        from dlo.operator.status import CONDITION_TYPES

        for condition in CONDITION_TYPES:
            for status in CONDITION_STATUSES:
                family.add_metric([condition, status], tally.get((condition, status), 0))
        yield family
        each = GaugeMetricFamily(
            "dlo_operator_dlodeployment_condition", "1 for each condition of each DLODeployment, with its status "
            "and reason", labels=["namespace", "deployment", "condition", "status", "reason"])
        for (namespace, name), conds in sorted(resources.items()):
            for condition, (status, reason) in sorted(conds.items()):
                each.add_metric([namespace, name, condition, status, reason], 1)
        yield each


CONDITIONS = _ConditionCollector()
REGISTRY.register(CONDITIONS)

FETCH_STATES = ("complete", "fetching", "pending", "failed")
FETCH_BYTES = Counter("dlo_model_fetch_bytes_total", "Bytes fetch Jobs moved onto nodes, by model (cache key)",
                      ["model"], registry=REGISTRY)


class _FetchCollector(Collector):
    """`dlo_model_fetch_state{model, state}` from each resource's last delivery status, and the
    bytes counted per fetch Job (so a Job's progress is counted once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_resource: dict[tuple[str, str], dict[str, dict[str, int]]] = {}  # -> cache key -> state counts
        self._seen: dict[str, tuple[int, int]] = {}  # running Job uid -> (first, last) bytes seen
        self._done: set[str] = set()  # finished Jobs already counted

    def observe(self, namespace: str, name: str, by_key: dict[str, list[str]]) -> None:
        """A resource's fetched sources (the model's and the adapters' cache keys) and their nodes' states."""
        with self._lock:
            self._by_resource[(namespace, name)] = {key: dict(Tally(states)) for key, states in by_key.items()}

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._by_resource.pop((namespace, name), None)

    def progressed(self, job_uid: str, model: str, done_bytes: int) -> None:
        """A running fetch Job's bytes on the node so far. The first sighting sets the baseline (a
        resumed fetch starts with bytes it did not move); each increase after it is counted."""
        with self._lock:
            baseline, last = self._seen.get(job_uid, (done_bytes, done_bytes))
            self._seen[job_uid] = (baseline, max(last, done_bytes))
        if done_bytes > last:
            FETCH_BYTES.labels(model).inc(done_bytes - last)

    def finished(self, job_uid: str, model: str, downloaded_bytes: int) -> None:
        """A finished fetch's own count of the bytes it moved: what its progress did not count yet."""
        with self._lock:
            baseline, last = self._seen.pop(job_uid, (0, 0))
            if job_uid in self._done:
                return
            self._done.add(job_uid)
        if downloaded_bytes > last - baseline:
            FETCH_BYTES.labels(model).inc(downloaded_bytes - (last - baseline))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            tally: Tally[tuple[str, str]] = Tally()
            for by_key in self._by_resource.values():
                for model, states in by_key.items():
                    for state in FETCH_STATES:
                        tally[(model, state)] += states.get(state, 0)
        family = GaugeMetricFamily("dlo_model_fetch_state", "Nodes per fetched model and fetch state",
                                   labels=["model", "state"])
        for (model, state), count in sorted(tally.items()):
            family.add_metric([model, state], count)
        yield family


FETCHES = _FetchCollector()
REGISTRY.register(FETCHES)


def serve(port: int, address: str = "0.0.0.0") -> Any:
    """Serve REGISTRY at http://ADDRESS:PORT/metrics in a daemon thread; returns the server."""
    server, _thread = start_http_server(port, address, registry=REGISTRY)
    return server
