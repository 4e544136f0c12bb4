"""operator/model_delivery.py, pure: which nodes hold a fetched model, which fetch it next, which
model the pods run while a new one is fetched, and the ModelReady verdict."""

from __future__ import annotations

from dlo.operator.model_delivery import DeliveryInputs, keys_in_use, plan_delivery
from dlo.operator.model_spec import ModelSource
from dlo.operator.models import parse_spec
from dlo.operator.names import FETCH_NODE_ANNOTATION, MODEL_KEY_ANNOTATION, model_label

URI = "s3://models/wan"
SPEC = parse_spec({"model": {"uri": URI}, "replicas": 2, "devicesPerNode": 8, "mode": "allgather"})
KEY = SPEC.model.cache_key


def node(name: str, *keys: str) -> dict:
    return {"metadata": {"name": name, "labels": {model_label(k): "true" for k in keys}, "annotations": {}},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}


def job(node_name: str, key: str = KEY, state: str | None = None, message: str = "") -> dict:
    conditions = [{"type": "Complete" if state == "succeeded" else "Failed", "status": "True"}] if state else []
    return {"metadata": {"name": f"wan-fetch-{node_name}", "uid": node_name,
                         "annotations": {FETCH_NODE_ANNOTATION: node_name, MODEL_KEY_ANNOTATION: key}},
            "status": {"conditions": conditions}}


def fetch_pod(job_name: str, message: str) -> dict:
    return {"metadata": {"name": f"{job_name}-x", "labels": {"job-name": job_name}},
            "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"message": message}}}]}}


def plan(nodes, jobs=(), pods=(), served=None, engine_nodes=(), active=None, max_fetches=4, spec=SPEC, now=1000.0,
         finished_at=999.0):
    return plan_delivery(DeliveryInputs(
        spec=spec, served=served, nodes=list(nodes), engine_nodes=list(engine_nodes), jobs=list(jobs),
        fetch_pods=list(pods), active_elsewhere=active or {"": 0}, in_use={}, progress_of=lambda j: (50, 200, 1, 4),
        now=now, max_fetches=max_fetches, retry_seconds=300, finished_at=lambda j: finished_at))


def test_the_pods_nodes_fetch_first_then_the_others_by_name():
    p = plan([node("a"), node("b"), node("c")], engine_nodes=["c"])
    assert p.model.start == ["c", "a"]
    assert p.verdict[:2] == ("False", "Fetching") and "0/2 nodes hold" in p.verdict[2]


def test_holders_need_no_fetch_and_make_the_model_ready():
    p = plan([node("a", KEY), node("b", KEY), node("c")])
    assert p.model.start == [] and p.verdict == ("True", "Fetched", f"2 of 2 nodes hold {URI}")
    assert p.model.fetches == {"a": {"state": "complete"}, "b": {"state": "complete"}}


def test_fetch_slots_are_shared_and_one_fetch_runs_per_node():
    p = plan([node("a"), node("b")], active={"": 4, "x": 4})
    assert p.model.start == [] and {n: s["state"] for n, s in p.model.fetches.items()} == {"a": "pending", "b": "pending"}
    assert "a waiting for a fetch slot" in p.verdict[2]
    p = plan([node("a"), node("b")], active={"": 1, "a": 1})  # a fetches for another resource
    assert p.model.start == ["b"] and p.model.fetches["a"]["state"] == "pending"


def test_a_running_fetch_reports_progress_and_is_not_started_twice():
    p = plan([node("a", KEY), node("b")], jobs=[job("b")])
    assert p.model.start == [] and p.model.fetches["b"] == {"state": "fetching", "bytes": 50, "totalBytes": 200, "percent": 25.0}
    assert "b fetching 25.0% (50 of 200 bytes)" in p.verdict[2]


def test_a_finished_fetch_labels_its_node_and_hands_back_evicted_keys():
    done = job("b", state="succeeded")
    pod = fetch_pod(done["metadata"]["name"], '{"state": "complete", "bytes": 200, "evicted": ["old-0123"]}')
    p = plan([node("a", KEY), node("b")], jobs=[done], pods=[pod])
    assert p.model.label == ["b"] and p.unlabel == [("b", "old-0123")] and p.delete == [done]
    assert p.verdict[0] == "True"


def test_a_failed_fetch_is_reported_then_retried_and_another_node_tries_meanwhile():
    failed = job("a", state="failed")
    pod = fetch_pod(failed["metadata"]["name"], '{"state": "failed", "reason": "disk_full", "message": "no room"}')
    p = plan([node("a"), node("b"), node("c")], jobs=[failed], pods=[pod])
    assert p.model.fetches["a"] == {"state": "failed", "reason": "disk_full", "message": "no room"}
    assert p.model.start == ["b", "c"] and p.delete == []
    later = plan([node("a"), node("b"), node("c")], jobs=[failed], pods=[pod], now=2000.0)
    assert later.delete == [failed]  # the retry delay is over: the next round starts it again
    only = plan([node("a")], jobs=[failed], pods=[pod], spec=SPEC.model_copy(update={"replicas": 1}))
    assert only.verdict[:2] == ("False", "FetchFailed") and "a: disk_full: no room" in only.verdict[2]


def test_a_new_uri_keeps_the_pods_on_their_model_until_enough_nodes_hold_the_new_one():
    served = ModelSource(uri="s3://models/wan-old")
    p = plan([node("a", served.cache_key), node("b", served.cache_key)], served=served)
    assert p.pods_model == served and "before the pods move to it: 0/2" in p.rolling_for_model
    assert sorted(p.model.start) == ["a", "b"]
    p = plan([node("a", served.cache_key, KEY), node("b", KEY)], served=served)
    assert p.pods_model == SPEC.model and p.rolling_for_model == ""


def test_jobs_of_a_model_no_longer_wanted_are_deleted():
    stale = job("a", key="other-0123456789ab")
    p = plan([node("a", KEY), node("b", KEY)], jobs=[stale])
    assert p.delete == [stale]


def test_keys_in_use_come_from_the_engine_pods_of_every_resource():
    pods = [{"metadata": {"labels": {"app.kubernetes.io/component": "engine"}, "annotations": {MODEL_KEY_ANNOTATION: "k1"}},
             "spec": {"nodeName": "a"}},
            {"metadata": {"labels": {"app.kubernetes.io/component": "fetch"}, "annotations": {MODEL_KEY_ANNOTATION: "k2"}},
             "spec": {"nodeName": "a"}}]
    assert keys_in_use(pods) == {"a": ["k1"]}


def test_a_finished_job_ends_at_its_own_stamps_else_at_its_creation():
    """A failed fetch is retried `fetch_retry_seconds` after it ended: its completion or condition
    time, and for a Job that carries neither, its creation (never "now", which would hold it back
    for good)."""
    from dlo.operator.delivery_run import _finished_at

    failed = job("node-0", state="failed")
    failed["metadata"]["creationTimestamp"] = "2026-12-01T10:00:00Z"
    assert _finished_at(failed) == 1796119200.0
    failed["status"]["conditions"][0]["lastTransitionTime"] = "2026-12-01T10:05:00Z"
    assert _finished_at(failed) == 1796119500.0
    failed["status"]["completionTime"] = "2026-12-01T10:06:00+00:00"
    assert _finished_at(failed) == 1796119560.0


LORA_URI = "s3://adapters/wan"
BOTH = parse_spec({"model": {"uri": URI}, "lora": {"uri": LORA_URI}, "replicas": 1, "devicesPerNode": 8,
                   "mode": "allgather"})
LORA_KEY = BOTH.lora.cache_key


def test_adapters_go_first_to_a_node_that_holds_the_model_and_wait_for_a_node_busy_with_it():
    p = plan([node("a"), node("b", KEY)], spec=BOTH)
    assert p.model.start == [] and p.lora.start == ["b"]  # b holds the model: one fetch makes it ready
    busy = plan([node("a"), node("b")], jobs=[job("a")], spec=BOTH)  # a fetches the model: the adapters wait
    assert busy.lora.start == [] and busy.lora.fetches["a"] == {"state": "pending"}
    assert busy.verdict[:2] == ("False", "Fetching")
    assert "nodes hold the adapters s3://adapters/wan; a waiting for a fetch slot" in busy.verdict[2]
    ready = plan([node("a", KEY, LORA_KEY)], spec=BOTH)
    assert ready.verdict == ("True", "Fetched", f"1 of 1 nodes hold {URI}; 1 of 1 nodes hold the adapters {LORA_URI}")


def test_a_failed_adapters_fetch_is_fetch_failed_naming_the_adapters_and_the_node():
    failed = job("a", key=LORA_KEY, state="failed")
    pod = fetch_pod(failed["metadata"]["name"], '{"state": "failed", "reason": "refused", "message": "no adapter"}')
    p = plan([node("a", KEY)], jobs=[failed], pods=[pod], spec=BOTH)
    assert p.lora.fetches["a"]["reason"] == "refused" and p.model.fetches["a"] == {"state": "complete"}
    assert p.verdict == ("False", "FetchFailed", f"0/1 nodes hold the adapters {LORA_URI}; a: refused: no adapter")


def test_new_adapters_keep_the_pods_on_theirs_until_enough_nodes_hold_them_and_the_model():
    spec = parse_spec({"model": {"path": "/models/wan"}, "lora": {"uri": LORA_URI}, "replicas": 1})
    before = spec.model_copy(update={"lora": None})
    p = plan([node("a")], served=spec.model, spec=spec)  # the pods ran without adapters
    assert p.model is None and p.lora.start == ["a"]
    assert p.pods_lora is None and p.pods_model == spec.model and "the adapters s3://adapters/wan" in p.rolling_for_model
    done = plan([node("a", LORA_KEY)], served=before.model, spec=spec)
    assert done.pods_lora == spec.lora and done.rolling_for_model == "" and done.verdict[:2] == ("True", "Fetched")


def test_keys_in_use_hold_the_adapters_of_the_engine_pods_too():
    from dlo.operator.names import LORA_KEY_ANNOTATION

    pods = [{"metadata": {"labels": {"app.kubernetes.io/component": "engine"},
                          "annotations": {MODEL_KEY_ANNOTATION: "k1", LORA_KEY_ANNOTATION: "l1"}},
             "spec": {"nodeName": "a"}}]
    assert keys_in_use(pods) == {"a": ["k1", "l1"]}
