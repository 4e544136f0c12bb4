"""Hostile DLODeployment specs: random invalid specs against both gates, the CRD's
openAPIV3Schema (what the API server checks) and the pydantic models (what the operator checks
again, CEL rules included). Every invalid spec is rejected by both, with a message; every valid
spec is accepted by both: the two gates agree.

The schema side is checked with jsonschema the way the API server applies a structural schema
under strict field validation (kubectl's default): unknown fields are errors, and
`x-kubernetes-int-or-string` means an integer or a string. CEL rules cannot run here; the
mutations that break one are checked to pass the schema, to carry the rule in the CRD, and to be
refused by pydantic with the rule's own message.

The rule that `engine.env` may not set `DLO_API_KEY` or `VLLM_API_KEY` is a CEL rule on the env
items; test_crd_cel.py and tests/reliability/test_privilege.py cover it. The Kubernetes types inside the spec (`engine.env`,
`engine.resources`, `placement.affinity`, `placement.tolerations`) carry their upstream schemas, so
the mutations reach into them too.

Invalid specs are made by mutating a random valid spec at a random place of the schema, with a
violation chosen from what the schema says there (type, enum, minimum/maximum, minLength,
pattern, unknown field), so new fields are fuzzed without changing this test.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlo.operator.crd import build_crd
from dlo.operator.models import SpecError, parse_spec

CRD_SPEC = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def strict_schema(node: Any) -> Any:
    """The structural schema as the API server enforces it, in plain JSON Schema."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


VALIDATOR = jsonschema.Draft202012Validator(strict_schema(CRD_SPEC))


def schema_errors(spec: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(spec)]


def cel_rules(path: tuple[str, ...]) -> list[dict]:
    node = CRD_SPEC
    for part in path:
        node = node["properties"][part]
    return node.get("x-kubernetes-validations", [])


# ---- valid specs -------------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)
labels = st.from_regex(r"[a-z]([a-z0-9-]{0,18}[a-z0-9])?", fullmatch=True)  # DNS labels: no trailing dash
paths = st.from_regex(r"/[a-z0-9._/-]{1,30}", fullmatch=True)
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
quantities = st.one_of(st.integers(0, 1 << 40), st.from_regex(r"[1-9][0-9]{0,3}(m|Mi|Gi|k|)", fullmatch=True))


@st.composite
def valid_specs(draw: st.DrawFn) -> dict:
    if draw(st.booleans()):
        model: dict[str, Any] = {"path": draw(paths)}
    else:
        model = {"claimName": draw(names)}
        if draw(st.booleans()):
            model["subPath"] = draw(st.sampled_from(["", "wan", "flux/dev/"]))
    if draw(st.booleans()):
        model["facts"] = {"bytes": draw(st.integers(1, 1 << 42)), "largestBlockBytes": draw(st.integers(1, 1 << 32))}
    spec: dict[str, Any] = {"model": model}
    optional = {
        "replicas": st.integers(0, 64),
        "devicesPerNode": st.integers(1, 16),
        "acceleratorResource": st.sampled_from(["nvidia.com/gpu", "huawei.com/Ascend910"]),
        "mode": st.sampled_from(["auto", "allgather", "rank-local", "resident"]),
        "engine": st.fixed_dictionaries({}, optional={
            "kind": st.sampled_from(["dlo", "vllm-omni"]),
            "image": names,
            "device": st.sampled_from(["auto", "cuda", "npu", "cpu"]),
            "args": st.lists(text, max_size=3),
            "env": st.lists(st.fixed_dictionaries({"name": names, "value": text}), max_size=2),
            "resources": st.fixed_dictionaries({}, optional={
                "requests": st.dictionaries(st.sampled_from(["cpu", "memory"]), quantities, max_size=2),
                "limits": st.dictionaries(st.sampled_from(["cpu", "memory", "nvidia.com/gpu"]), quantities, max_size=2)}),
            "apiKeySecret": st.fixed_dictionaries({"name": names}, optional={"key": names}),
            "apiKeys": st.fixed_dictionaries({"secretName": names}, optional={"admins": st.lists(labels, max_size=2)}),
            "shmSize": st.sampled_from(["1Gi", "64Gi"]),
            "pinMemoryLock": st.booleans(),
        }),
        "warmer": st.fixed_dictionaries({}, optional={
            "enabled": st.booleans(), "threshold": st.floats(0, 1), "image": names}),
        "placement": st.fixed_dictionaries({}, optional={
            "nodeSelector": st.dictionaries(names, names, max_size=2), "priorityClassName": names,
            "tolerations": st.lists(st.fixed_dictionaries({"key": names}, optional={
                "operator": st.sampled_from(["Exists", "Equal"]), "value": names,
                "effect": st.sampled_from(["NoSchedule", "NoExecute"]), "tolerationSeconds": st.integers(0, 600)}),
                max_size=2),
            "affinity": st.fixed_dictionaries({}, optional={"nodeAffinity": st.fixed_dictionaries({}, optional={
                "preferredDuringSchedulingIgnoredDuringExecution": st.lists(st.fixed_dictionaries({
                    "weight": st.integers(1, 100),
                    "preference": st.fixed_dictionaries({"matchExpressions": st.lists(st.fixed_dictionaries({
                        "key": names, "operator": st.sampled_from(["In", "NotIn", "Exists"]),
                        "values": st.lists(names, max_size=2)}), max_size=2)})}), max_size=2)})})}),
        "rollout": st.one_of(
            st.fixed_dictionaries({}, optional={"type": st.just("Recreate")}),
            st.fixed_dictionaries({}, optional={"type": st.just("RollingUpdate"), "maxUnavailable": st.one_of(
                st.integers(1, 100), st.integers(1, 100).map(lambda n: f"{n}%"))}),
        ),
        "service": st.fixed_dictionaries({}, optional={
            "type": st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]), "port": st.integers(1, 65535)}),
        "monitoring": st.fixed_dictionaries({}, optional={
            "enabled": st.booleans(), "kind": st.sampled_from(["PodMonitor", "ServiceMonitor"]),
            "labels": st.dictionaries(names, names, max_size=2)}),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            spec[key] = draw(strategy)
    engine = spec.get("engine", {})
    if "apiKeys" in engine:  # one source of keys, and named keys are dlo's
        engine.pop("apiKeySecret", None)
        engine.pop("kind", None)
    return spec


# ---- invalid specs: a schema-driven mutation of a valid one ---------------------------------

JSON_KINDS = {
    # strings a lax parser would coerce ("3" to 3, "yes" to True) come up often
    "string": st.one_of(st.sampled_from(["3", "1", "0.5", "true", "yes", "on"]), st.text(max_size=5)),
    "integer": st.integers(-5, 5),
    "number": st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
    "boolean": st.booleans(),
    "array": st.lists(st.integers(), max_size=2),
    "object": st.dictionaries(names, st.integers(), max_size=2),
}


def leaves(node: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """Every property of the schema (objects too), by path."""
    out = [(path, node)] if path else []
    for key, child in node.get("properties", {}).items():
        out += leaves(child, path + (key,))
    return out


LEAVES = [((), CRD_SPEC)] + leaves(CRD_SPEC)


def wrong_kinds(node: dict) -> list[str]:
    if node.get("x-kubernetes-int-or-string"):
        allowed = {"integer", "string"}
    else:
        allowed = {node["type"]} | ({"integer"} if node["type"] == "number" else set())
    return [k for k in JSON_KINDS if k not in allowed]


@st.composite
def violations(draw: st.DrawFn, node: dict) -> tuple[str, Any]:
    """(what is wrong, a value) that the schema node at some path refuses."""
    options: list[tuple[str, st.SearchStrategy]] = []
    if node is not CRD_SPEC:  # the spec itself is always an object: only unknown fields
        kind = draw(st.sampled_from(wrong_kinds(node)))
        options.append((f"type {kind}", JSON_KINDS[kind]))
    if "enum" in node:
        options.append(("enum", st.text(max_size=12).filter(lambda s: s not in node["enum"])))
    if "minimum" in node:
        options.append(("minimum", st.integers(-(1 << 40), int(node["minimum"]) - 1)))
    if "maximum" in node:
        options.append(("maximum", st.integers(int(node["maximum"]) + 1, 1 << 40)))
    if node.get("minLength"):
        options.append(("minLength", st.just("")))
    if "pattern" in node:
        refused = [v for v in ("0%", "101%", "half", "25", "%", "1e2%") if not re.search(node["pattern"], v)]
        options.append(("pattern", st.sampled_from(refused)))  # "25" is a byte size (engine.maxDeviceMemory)
    if node.get("type") == "array" and "items" in node and "type" in node["items"]:
        item_kind = draw(st.sampled_from(wrong_kinds(node["items"])))
        options.append((f"item type {item_kind}", st.lists(JSON_KINDS[item_kind], min_size=1, max_size=2)))
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        options.append(("unknown field", st.just("__unknown__")))
    if node.get("additionalProperties", {}).get("type") == "string":
        options.append(("map value type", st.dictionaries(names, st.integers(), min_size=1, max_size=2)))
    what, strategy = draw(st.sampled_from(options))
    return what, draw(strategy)


def set_at(spec: dict, path: tuple[str, ...], what: str, value: Any) -> None:
    if not path:  # the spec itself: only an unknown field
        spec["replicaCount"] = 3
        return
    parent = spec
    for part in path[:-1]:
        child = parent.get(part)
        if not isinstance(child, dict):
            child = parent[part] = {}
        parent = child
    if what == "unknown field":
        target = parent.setdefault(path[-1], {})
        if not isinstance(target, dict):
            target = parent[path[-1]] = {}
        target["replicaCount"] = 3  # a plausible typo
    else:
        parent[path[-1]] = value


@st.composite
def invalid_specs(draw: st.DrawFn) -> tuple[dict, str, tuple[str, ...]]:
    spec = copy.deepcopy(draw(valid_specs()))
    path, node = draw(st.sampled_from(LEAVES))
    what, value = draw(violations(node))
    set_at(spec, path, what, value)
    return spec, what, path


@st.composite
def cel_breaking_specs(draw: st.DrawFn) -> tuple[dict, tuple[str, ...]]:
    spec = draw(valid_specs())
    case = draw(st.sampled_from(["both sources", "no source", "maxUnavailable without RollingUpdate",
                                 "sp not dividing devicesPerNode", "both key sources"]))
    if case == "both key sources":
        engine = {k: v for k, v in spec.get("engine", {}).items() if k != "kind"}
        spec["engine"] = {**engine, "apiKeySecret": {"name": draw(names)}, "apiKeys": {"secretName": draw(names)}}
        return spec, ("engine",)
    if case == "sp not dividing devicesPerNode":
        spec["devicesPerNode"] = draw(st.sampled_from([1, 3, 5, 7]))
        spec["sp"] = draw(st.sampled_from([2, 4]))
        return spec, ()
    if case == "both sources":
        spec["model"] = {**spec["model"], "path": draw(paths), "claimName": draw(names)}
        return spec, ("model",)
    if case == "no source":
        spec["model"] = {k: v for k, v in spec["model"].items() if k not in ("path", "claimName")}
        return spec, ("model",)
    spec["rollout"] = {"maxUnavailable": draw(st.integers(1, 5)), "type": "Recreate"}
    return spec, ("rollout",)


# ---- the properties ------------------------------------------------------------------------------


@EXAMPLES
@given(valid_specs())
def test_valid_specs_pass_both_gates(spec):
    assert schema_errors(spec) == []
    parse_spec(json.loads(json.dumps(spec)))


@EXAMPLES
@given(invalid_specs())
def test_invalid_specs_are_refused_by_the_schema_and_by_pydantic_with_a_message(case):
    spec, what, path = case
    errors = schema_errors(spec)
    assert errors, f"the CRD schema accepts {what} at {'.'.join(path)}: {spec}"
    with pytest.raises(SpecError) as refused:
        parse_spec(json.loads(json.dumps(spec)))
    message = str(refused.value)
    assert message.startswith("spec.") and len(message) > 10
    where = ".".join(path)
    if what != "unknown field":
        # pydantic names the field (or its parent, for a rule of the enclosing object)
        assert f"spec.{where}" in message or f"spec.{'.'.join(path[:-1])}" in message, (what, where, message)


@EXAMPLES
@given(cel_breaking_specs())
def test_cel_rule_violations_pass_the_schema_and_pydantic_refuses_with_the_rule_message(case):
    spec, path = case
    assert schema_errors(spec) == []  # only the CEL rule can catch these
    rules = cel_rules(path)
    assert rules
    with pytest.raises(SpecError) as refused:
        parse_spec(json.loads(json.dumps(spec)))
    assert any(rule["message"] in str(refused.value) for rule in rules), str(refused.value)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"model": {"path": "/m"}, "replicas": "3"}, "spec.replicas"),
        ({"model": {"path": "/m"}, "warmer": {"enabled": "yes"}}, "spec.warmer.enabled"),
        ({"model": {"path": "/m"}, "warmer": {"threshold": "0.5"}}, "spec.warmer.threshold"),
        ({"model": {"path": "/m"}, "rollout": {"type": "RollingUpdate", "maxUnavailable": "0%"}}, "spec.rollout"),
    ],
    ids=["string-int", "string-bool", "string-float", "zero-percent"],
)
def test_values_the_api_server_refuses_are_not_coerced_by_the_operator(spec, field):
    assert schema_errors(spec)
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec(spec)
