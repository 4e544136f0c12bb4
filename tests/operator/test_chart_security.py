"""charts/dlo security objects: the ValidatingAdmissionPolicy that narrows the operator's and the
agent's node patches to DLO's own keys, evaluated for real (cel-python) on admission requests built
from the patches the operator and the agent send."""

from __future__ import annotations

from typing import Any

import celpy
import kubernetes_validate
import pytest

from dlo.operator.model_delivery import node_label_patch
from dlo.operator.names import MODEL_LABEL_PREFIX
from dlo.plan.profile import ANNOTATION
from emulator import merge as merge_patch  # RFC 7386, as the API server applies a merge patch
from test_chart import by_kind, named, render

OPERATOR = "system:serviceaccount:dlo-system:dlo-operator"
AGENT = "system:serviceaccount:dlo-system:dlo-agent"
NODE = {"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "gpu-1", "labels": {"kubernetes.io/hostname": "gpu-1", "nvidia.com/gpu.present": "true",
                                                  "model.dlo.dev/old": "true"},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0", ANNOTATION: '{"version": "v1"}'}},
        "spec": {"podCIDR": "10.0.1.0/24", "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}


class Policy:
    """The rendered policy, compiled once: `admit` answers what the API server would."""

    def __init__(self, policy: dict[str, Any]) -> None:
        self.env = celpy.Environment()
        spec = policy["spec"]
        self.conditions = [self._program(c["expression"]) for c in spec["matchConditions"]]
        self.variables = [(v["name"], self._program(v["expression"])) for v in spec["variables"]]
        self.validations = [(self._program(v["expression"]), v["message"]) for v in spec["validations"]]

    def _program(self, expression: str) -> Any:
        return self.env.program(self.env.compile(expression))

    def admit(self, user: str, old: dict[str, Any], new: dict[str, Any], node_name: str | None = "gpu-1") -> list[str]:
        """The messages of the validations that deny the update ([]: admitted or not matched)."""
        extra = {"authentication.kubernetes.io/node-name": [node_name]} if node_name else {}
        act: dict[str, Any] = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old),
                               "request": celpy.json_to_cel({"operation": "UPDATE", "userInfo": {
                                   "username": user, "extra": extra}})}
        if not all(self._true(p, act) for p in self.conditions):
            return []
        variables = celpy.celtypes.MapType({})
        for name, program in self.variables:  # in order: a variable may read the ones before it
            act["variables"] = variables
            value = program.evaluate(act)
            assert not isinstance(value, celpy.CELEvalError), (name, value)
            variables = celpy.celtypes.MapType({**variables, celpy.celtypes.StringType(name): value})
        act["variables"] = variables
        return [message for program, message in self.validations if not self._true(program, act)]

    @staticmethod
    def _true(program: Any, act: dict[str, Any]) -> bool:
        result = program.evaluate(act)
        assert not isinstance(result, celpy.CELEvalError), result  # an error denies (failurePolicy Fail)
        return bool(result)


@pytest.fixture(scope="module")
def policy() -> Policy:
    objs = render(None)
    (vap,) = by_kind(objs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(objs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert vap["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}]
    for obj in (vap, binding):
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    return Policy(vap)


def patched(patch: dict[str, Any]) -> dict[str, Any]:
    return merge_patch(NODE, patch)


def test_the_patches_the_operator_and_the_agent_send_are_admitted(policy: Policy) -> None:
    assert policy.admit(OPERATOR, NODE, patched(node_label_patch("wan-abc", True))) == []
    assert policy.admit(OPERATOR, NODE, patched(node_label_patch("old", False))) == []  # evicted
    profile = {"metadata": {"annotations": {ANNOTATION: '{"version": "v1", "node": "gpu-1"}'}}}  # KubernetesPods.annotate_node
    assert policy.admit(AGENT, NODE, patched(profile)) == []
    assert policy.admit(AGENT, NODE, patched(profile), node_name=None) == []  # a cluster older than 1.30


@pytest.mark.parametrize("user, patch, denied", [
    (OPERATOR, {"spec": {"taints": None}}, "spec"),
    (OPERATOR, {"spec": {"unschedulable": True}}, "spec"),
    (OPERATOR, {"metadata": {"labels": {"nvidia.com/gpu.present": None}}}, "labels"),
    (OPERATOR, {"metadata": {"labels": {"node-role.kubernetes.io/secure": "true"}}}, "labels"),
    (OPERATOR, {"metadata": {"annotations": {ANNOTATION: "{}"}}}, "annotations"),
    (OPERATOR, {"metadata": {"finalizers": ["example.com/hold"]}}, "finalizers"),
    (AGENT, {"metadata": {"labels": {"model.dlo.dev/forged": "true"}}}, "labels"),
    (AGENT, {"metadata": {"labels": {"model.dlo.dev/old": None}}}, "labels"),
    (AGENT, {"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": "30"}}}, "annotations"),
    (AGENT, {"metadata": {"annotations": {ANNOTATION: None}, "ownerReferences": [
        {"apiVersion": "v1", "kind": "Namespace", "name": "x", "uid": "1"}]}}, "owner references"),
    (AGENT, {"spec": {"taints": [{"key": "evil", "effect": "NoExecute"}]}}, "spec"),
])
def test_anything_but_dlos_own_keys_is_denied(policy: Policy, user: str, patch: dict[str, Any], denied: str) -> None:
    messages = policy.admit(user, NODE, patched(patch))
    assert len(messages) == 1 and denied in messages[0], messages


def test_the_agent_annotates_only_its_own_node_and_others_are_not_matched(policy: Policy) -> None:
    profile = patched({"metadata": {"annotations": {ANNOTATION: "{}"}}})
    assert policy.admit(AGENT, NODE, profile, node_name="gpu-2") == ["DLO's agent may annotate only the node it runs on"]
    anything = patched({"spec": {"unschedulable": True}, "metadata": {"labels": {"x": "y"}}})
    for user in ("system:node:gpu-1", "system:serviceaccount:kube-system:node-controller",
                 "system:serviceaccount:other:dlo-operator"):
        assert policy.admit(user, NODE, anything) == []  # not DLO's accounts: the policy does not apply


def test_the_policy_names_the_keys_the_code_writes_and_follows_the_values() -> None:
    objs = render(None)
    text = str(named(objs, "ValidatingAdmissionPolicy", "dlo-node-patch")["spec"])
    assert f"'{MODEL_LABEL_PREFIX}'" in text and f"'{ANNOTATION}'" in text
    renamed = render({"operator": {"serviceAccount": {"name": "ops"}}, "agent": {"serviceAccount": {"name": "ag"}}})
    (vap,) = by_kind(renamed, "ValidatingAdmissionPolicy")
    assert vap["spec"]["matchConditions"][0]["expression"] == (
        "request.userInfo.username in ['system:serviceaccount:dlo-system:ops', 'system:serviceaccount:dlo-system:ag']")
    assert not by_kind(render({"nodePatchPolicy": {"enabled": False}}), "ValidatingAdmissionPolicy")
    assert not by_kind(render({"operator": {"enabled": False}, "agent": {"enabled": False}}),
                       "ValidatingAdmissionPolicyBinding")


def test_notes_say_who_may_reach_the_engines_and_that_node_patches_are_narrowed():
    from test_chart import notes

    text = notes(None)
    assert "a NetworkPolicy per DLODeployment" in text and "the pods of monitoring and the DLO agents" in text
    assert "networkPolicy.clientNamespaceSelector" in text and "ValidatingAdmissionPolicy dlo-node-patch" in text
    off = notes({"networkPolicy": {"enabled": False}, "nodePatchPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in off and "node-patch" not in off
