"""operator/status.py: conditions bookkeeping and the status summary from pods and profiles."""

from dlo.operator import status

H = "dlo.dev/template-hash"


def pod(name: str, node: str | None, ready: bool, template: str = "new", deleting: bool = False) -> dict:
    meta = {"name": name, "annotations": {H: template}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": "Running" if ready else "Pending", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_transition_time_moves_only_when_status_changes():
    conds = status.set_condition([], "Ready", "False", "ReplicasNotReady", at="2026-01-01T00:00:00Z")
    conds = status.set_condition(conds, "Ready", "False", "ReplicasNotReady", "0/2", at="2026-01-02T00:00:00Z")
    assert conds[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and conds[0]["message"] == "0/2"
    conds = status.set_condition(conds, "Ready", "True", "AllReplicasReady", generation=3, at="2026-01-03T00:00:00Z")
    assert conds[0]["lastTransitionTime"] == "2026-01-03T00:00:00Z" and conds[0]["observedGeneration"] == 3


def test_conditions_keep_a_stable_order():
    conds = status.set_condition([], "Degraded", "False", "SpecValid")
    conds = status.set_condition(conds, "Ready", "True", "AllReplicasReady")
    assert [c["type"] for c in conds] == ["Ready", "Degraded"]


def summarize(pods, desired=2, cached=None, threshold=0.9, warm=True, **more):
    return status.summarize(status.Observed(desired, "new", pods, cached or {}, threshold, warm, H, **more))


def test_all_ready_on_current_template():
    s = summarize([pod("w-0", "n1", True), pod("w-1", "n2", True)], cached={"n1": 0.95, "n2": 0.99})
    assert (s["replicas"], s["readyReplicas"], s["updatedReplicas"]) == (2, 2, 2)
    assert s["verdicts"]["Ready"][0] == "True" and s["verdicts"]["Progressing"][0] == "False"
    assert s["verdicts"]["CacheWarmed"][:2] == ("True", "PageCacheWarm") and s["cachedRatio"] == 0.95
    assert s["nodes"] == [
        {"name": "n1", "phase": "Running", "cachedRatio": 0.95},
        {"name": "n2", "phase": "Running", "cachedRatio": 0.99},
    ]


def test_old_template_and_terminating_pods_are_not_counted():
    s = summarize([pod("w-0", "n1", True, template="old"), pod("w-1", "n2", True, deleting=True)])
    assert (s["replicas"], s["readyReplicas"], s["updatedReplicas"]) == (1, 1, 0)
    assert s["verdicts"]["Ready"][0] == "False" and s["verdicts"]["Progressing"][:2] == ("True", "RollingOut")


def test_cache_verdicts():
    assert summarize([pod("w-0", "n1", True)], 1, {"n1": 0.5})["verdicts"]["CacheWarmed"][:2] == ("False", "PageCacheCold")
    assert summarize([pod("w-0", "n1", True)], 1, {})["verdicts"]["CacheWarmed"][1] == "NoResidencyReported"
    assert summarize([pod("w-0", None, False)], 1, {})["nodes"] == []
    assert summarize([], 1, warm=False)["verdicts"]["CacheWarmed"][1] == "WarmerDisabled"


def test_scaled_to_zero_is_ready():
    s = summarize([], desired=0)
    assert s["verdicts"]["Ready"][:2] == ("True", "ScaledToZero") and s["verdicts"]["Progressing"][0] == "False"


def pod_with(name: str, *statuses: dict, init: tuple[dict, ...] = (), deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"containerStatuses": list(statuses), "initContainerStatuses": list(init)}}


CRASHING = {"name": "engine", "restartCount": 5, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}
RUNNING = {"name": "engine", "restartCount": 5, "ready": True, "state": {"running": {}}}


def test_crash_looping_names_pod_container_restarts_and_last_exit():
    from dlo.operator.status import crash_looping

    assert crash_looping([pod_with("wan-1", RUNNING), pod_with("wan-0", CRASHING)]) == [
        "pod wan-0 container engine: CrashLoopBackOff, 5 restarts, last exit 1 (Error)"
    ]


def test_repeated_restarts_count_before_the_kubelet_says_crash_loop_and_a_running_container_does_not():
    from dlo.operator.status import CRASH_RESTARTS, crash_looping

    terminated = {"name": "engine", "restartCount": CRASH_RESTARTS,
                  "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    assert crash_looping([pod_with("wan-0", terminated)]) == [
        f"pod wan-0 container engine: restarting, {CRASH_RESTARTS} restarts, last exit 137 (OOMKilled)"
    ]
    few = {**terminated, "restartCount": CRASH_RESTARTS - 1}
    assert crash_looping([pod_with("wan-0", few)]) == []
    assert crash_looping([pod_with("wan-0", RUNNING)]) == []  # restarted in the past, running now
    assert crash_looping([pod_with("wan-0", CRASHING, deleting=True)]) == []  # on its way out


def test_a_crash_looping_warmer_counts_too():
    from dlo.operator.status import crash_looping

    warm = {**CRASHING, "name": "warm"}
    assert crash_looping([pod_with("wan-0", init=(warm,))])[0].startswith("pod wan-0 container warm: CrashLoopBackOff")
