"""operator/metrics.py: the operator's own metrics, as the handlers and the client feed them
(scraped over HTTP from a real `dlo operator run` in test_cli.py)."""

import socket
import urllib.request

import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from cluster import dlodeployment, running_cluster
from dlo.operator import metrics
from dlo.operator.kube import Kube


def value(name: str, default: float | None = None, **labels: str) -> float:
    for family in text_string_to_metric_families(fetch()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    if default is not None:
        return default
    raise KeyError((name, labels))


_SERVER: list = []


def fetch() -> str:
    if not _SERVER:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _SERVER.append((metrics.serve(port, "127.0.0.1"), port))
    with urllib.request.urlopen(f"http://127.0.0.1:{_SERVER[0][1]}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_every_result_and_condition_series_exists_from_the_start():
    for result in metrics.RESULTS:
        value("dlo_operator_reconciles_total", result=result)
    for condition in ("Ready", "Progressing", "CacheWarmed", "Degraded"):
        for st in ("True", "False", "Unknown"):
            value("dlo_operator_dlodeployments", condition=condition, status=st)


def test_conditions_are_counted_per_resource_and_forgotten():
    before = value("dlo_operator_dlodeployments", condition="Ready", status="True")
    metrics.CONDITIONS.observe("ns", "a", [{"type": "Ready", "status": "True"}])
    metrics.CONDITIONS.observe("ns", "a", [{"type": "Ready", "status": "True"}])  # the same resource again
    metrics.CONDITIONS.observe("ns", "b", [{"type": "Ready", "status": "False"}])
    assert value("dlo_operator_dlodeployments", condition="Ready", status="True") == before + 1
    assert value("dlo_operator_dlodeployment_condition", namespace="ns", deployment="b", condition="Ready",
                 status="False", reason="") == 1
    metrics.CONDITIONS.forget("ns", "a")
    metrics.CONDITIONS.forget("ns", "b")
    assert value("dlo_operator_dlodeployments", condition="Ready", status="True") == before
    with pytest.raises(KeyError):
        value("dlo_operator_dlodeployment_condition", namespace="ns", deployment="b", condition="Ready",
              status="False", reason="")


def test_an_unanswered_api_request_counts_as_an_api_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens
    before = value("dlo_operator_api_errors_total", 0, code="none")
    with pytest.raises(urllib3.exceptions.HTTPError):
        Kube.for_url(f"http://127.0.0.1:{port}", timeout=2).list("v1", "Node")
    assert value("dlo_operator_api_errors_total", code="none") == before + 1


async def test_reconciles_are_counted_and_timed_and_a_deleted_resource_leaves_the_gauge():
    before_ok = value("dlo_operator_reconciles_total", result="success")
    before_invalid = value("dlo_operator_reconciles_total", result="invalid_spec")
    before_count = value("dlo_operator_reconcile_duration_seconds_count")
    async with running_cluster() as cluster:
        await cluster.create(dlodeployment("good", "m", {"model": {"path": "/models/tiny"}, "engine": {"device": "cpu"}}))
        await cluster.create(dlodeployment("bad", "m", {"model": {"path": "/m", "claimName": "c"}}))
        await cluster.wait(lambda: value("dlo_operator_reconciles_total", result="success") > before_ok
                           and value("dlo_operator_reconciles_total", result="invalid_spec") > before_invalid,
                           what="both results counted")
        assert value("dlo_operator_reconcile_duration_seconds_count") >= before_count + 2
        await cluster.wait(lambda: ("m", "bad") in metrics.CONDITIONS._by_resource, what="bad observed")
        assert metrics.CONDITIONS._by_resource[("m", "bad")]["Degraded"] == ("True", "InvalidSpec")
        # what the Degraded alert selects: one series a condition of each resource, with its reason
        assert value("dlo_operator_dlodeployment_condition", namespace="m", deployment="bad", condition="Degraded",
                     status="True", reason="InvalidSpec") == 1
        assert await cluster.delete_dlod("m", "bad")
        await cluster.wait(lambda: ("m", "bad") not in metrics.CONDITIONS._by_resource, what="bad forgotten")
