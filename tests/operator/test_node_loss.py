"""Engine pods on lost nodes, on the emulated cluster: a node stops reporting, the taint manager
evicts its pods and they stay Terminating (no kubelet confirms); the operator names the node in
Degraded (reason NodeLost) and the documented ways out work: the node's out-of-service taint, or
the opt-in `spec.rollout.nodeLossGraceSeconds` after which the operator force-deletes the pod."""

from cluster import dlodeployment, running_cluster
from controllers import healthy
from emulator import now
from test_handlers import NS, SPEC, add_gpu_nodes, condition

UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
OUT_OF_SERVICE = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}


async def lose(cluster, node: str) -> None:
    """What the node lifecycle controller writes when a kubelet stops posting status."""
    stamp = now()
    await cluster.call(cluster.kube.patch, "v1", "Node", None, node, {
        "spec": {"taints": [{**UNREACHABLE, "timeAdded": stamp}]},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                   "message": "Kubelet stopped posting node status.", "lastTransitionTime": stamp}]}})


def degraded(cluster) -> dict:
    return condition(cluster, "Degraded") or {}


def serving_elsewhere(cluster, pod: str, node: str) -> bool:
    p = cluster.get("Pod", NS, pod)
    return p is not None and p["spec"].get("nodeName") == node and healthy(p)


async def test_a_pod_on_a_lost_node_names_the_node_and_the_out_of_service_taint_frees_it():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster, count=3)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        assert cluster.get("Pod", NS, "wan-1")["spec"]["nodeName"] == "node-1"
        await lose(cluster, "node-1")
        await cluster.wait(lambda: degraded(cluster).get("reason") == "NodeLost"
                           and "Terminating" in degraded(cluster).get("message", ""), what="Degraded NodeLost")
        message = degraded(cluster)["message"]
        assert degraded(cluster)["status"] == "True"
        assert message.startswith("pod wan-1: node node-1 is unreachable (its kubelet stopped reporting): "
                                  "NodeStatusUnknown since "), message
        assert "kubectl taint nodes node-1 node.kubernetes.io/out-of-service=nodeshutdown:NoExecute" in message
        assert (condition(cluster, "Ready") or {}).get("reason") == "NodeLost"
        held = cluster.get("Pod", NS, "wan-1")
        assert held["metadata"].get("deletionTimestamp") and held["spec"]["nodeName"] == "node-1"
        assert cluster.events("NodeLost") and not cluster.events("PodForceDeleted")
        # the documented recovery: the node is down for good
        await cluster.call(cluster.kube.patch, "v1", "Node", None, "node-1",
                           {"spec": {"taints": [{**UNREACHABLE}, OUT_OF_SERVICE]}})
        await cluster.wait(lambda: serving_elsewhere(cluster, "wan-1", "node-2"), what="wan-1 recreated on node-2")
        await cluster.wait(lambda: degraded(cluster).get("status") == "False"
                           and (condition(cluster, "Ready") or {}).get("status") == "True", what="recovered")


async def test_the_opt_in_grace_force_deletes_a_pod_held_by_a_lost_node():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster, count=3)
        await cluster.create(dlodeployment("wan", NS, {**SPEC, "rollout": {"nodeLossGraceSeconds": 2}}))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        await lose(cluster, "node-1")
        await cluster.wait(lambda: degraded(cluster).get("reason") == "NodeLost", what="Degraded NodeLost")
        assert "the operator force-deletes it 2s after the node was lost" in degraded(cluster)["message"]
        await cluster.wait(lambda: cluster.events("PodForceDeleted"), what="the stuck pod force-deleted")
        (event,) = cluster.events("PodForceDeleted")
        assert event["type"] == "Warning"
        assert event["message"].startswith("force-deleted pod wan-1: node node-1 is unreachable"), event["message"]
        await cluster.wait(lambda: serving_elsewhere(cluster, "wan-1", "node-2"), what="wan-1 recreated on node-2")
        await cluster.wait(lambda: degraded(cluster).get("status") == "False", what="Degraded cleared")
