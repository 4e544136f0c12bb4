"""The CRD's CEL rules (`x-kubernetes-validations`), evaluated with a CEL implementation (celpy,
from cel-python) the way the API server runs them: on the object after the schema's defaults are
applied, with `self` bound to the object at the rule's place. The API emulator in the other tests
does not evaluate CEL; here every rule of the generated CRD runs against valid and invalid objects,
and agrees with the operator's pydantic models on random specs."""

from __future__ import annotations

import copy
import re
import json
from typing import Any

import celpy
import pytest
from hypothesis import given
from test_models_fuzz import EXAMPLES, cel_breaking_specs, schema_errors, valid_specs

from dlo.operator.crd import build_crd
from dlo.operator.models import SpecError, parse_spec

SPEC_SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
ENV = celpy.Environment()


def rules(node: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """Every CEL rule of the schema, with the path of the object it validates."""
    out = [(path, r) for r in node.get("x-kubernetes-validations", [])]
    for key, child in node.get("properties", {}).items():
        out += rules(child, path + (key,))
    if "items" in node:
        out += rules(node["items"], path + ("[]",))
    return out


RULES = rules(SPEC_SCHEMA)
PROGRAMS = {r["rule"]: ENV.program(ENV.compile(r["rule"])) for _, r in RULES}


def defaulted(value: Any, node: dict) -> Any:
    """`value` with the schema's defaults filled in, as the API server does before validating."""
    if isinstance(value, dict) and "properties" in node:
        value = dict(value)
        for key, child in node["properties"].items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
            if key in value:
                value[key] = defaulted(value[key], child)
    return value


def evaluate(rule: str, self_value: Any) -> bool:
    result = PROGRAMS[rule].evaluate({"self": celpy.json_to_cel(self_value)})
    if isinstance(result, celpy.CELEvalError):
        raise AssertionError(f"{rule!r} fails to evaluate on {self_value}: {result}")
    return bool(result)


def at(node: dict, path: tuple[str, ...]) -> dict:
    for part in path:
        node = node["items"] if part == "[]" else node["properties"][part]
    return node


def values_at(value: Any, path: tuple[str, ...]) -> list[Any]:
    """The values a rule at `path` sees in `value` (one per list item below a `[]`)."""
    if not path:
        return [value]
    head, rest = path[0], path[1:]
    if head == "[]":
        return [v for item in (value if isinstance(value, list) else []) for v in values_at(item, rest)]
    if isinstance(value, dict) and head in value:
        return values_at(value[head], rest)
    return []


def placed(path: tuple[str, ...], value: Any) -> dict:
    """A spec holding `value` at `path` (a list of one item for `[]`)."""
    spec: dict[str, Any] = {"model": {"path": "/m"}}
    for part in reversed(path):
        value = [value] if part == "[]" else {part: value}
    spec.update(value)
    if path == ("pod", "volumeMounts", "[]"):  # a mount names a volume of the pod (another rule)
        spec["pod"]["volumes"] = [{"name": m["name"], "emptyDir": {}} for m in spec["pod"]["volumeMounts"]]
    return spec


# (rule place, object there, the rule holds): at least one valid and one invalid object per rule.
CASES: dict[str, list[tuple[dict, bool]]] = {
    "(has(self.path) ? 1 : 0) + (has(self.claimName) ? 1 : 0) + (has(self.uri) ? 1 : 0) == 1": [
        ({"path": "/models/wan"}, True),
        ({"claimName": "models", "subPath": "wan"}, True),
        ({"uri": "s3://models/wan"}, True),
        ({"uri": "hf://Wan-AI/Wan2.1-T2V-14B-Diffusers@main"}, True),
        ({"path": "/models/wan", "claimName": "models"}, False),
        ({"path": "/models/wan", "uri": "s3://models/wan"}, False),
        ({"claimName": "models", "uri": "hf://org/name"}, False),
        ({"subPath": "wan"}, False),
        ({}, False),
    ],
    "has(self.uri) || (!has(self.secretRef) && !has(self.endpoint))": [
        ({"path": "/models/wan"}, True),
        ({"uri": "s3://models/wan", "secretRef": {"name": "s3"}, "endpoint": "http://minio:9000"}, True),
        ({"path": "/models/wan", "secretRef": {"name": "s3"}}, False),
        ({"claimName": "models", "endpoint": "http://minio:9000"}, False),
    ],
    # spec.autoscaling (issue 31)
    "self.minReplicas <= self.maxReplicas": [
        ({}, True),
        ({"minReplicas": 1, "maxReplicas": 1}, True),
        ({"minReplicas": 3, "maxReplicas": 3}, True),
        ({"minReplicas": 5}, False),  # maxReplicas defaults to 4 first
        ({"minReplicas": 2, "maxReplicas": 1}, False),
    ],
    "self.minReplicas >= 1": [
        ({}, True),
        ({"minReplicas": 1, "engine": "hpa"}, True),
        ({"minReplicas": 2, "engine": "keda"}, True),
        ({"minReplicas": 0}, False),
        ({"minReplicas": 0, "engine": "keda"}, False),
        ({"minReplicas": 0, "engine": "hpa"}, False),
    ],
    "!has(self.videos) || !has(self.videos.claimName) || !has(self.engine) || !has(self.engine.kind)"
    " || self.engine.kind == 'dlo'": [
        ({}, True),
        ({"videos": {"claimName": "videos"}}, True),
        ({"videos": {"claimName": "videos"}, "engine": {"kind": "dlo"}}, True),
        ({"engine": {"kind": "vllm-omni"}}, True),
        ({"videos": {"claimName": "videos"}, "engine": {"kind": "vllm-omni"}}, False),
    ],
    "!has(self.maxUnavailable) || self.type == 'RollingUpdate'": [
        ({}, True),
        ({"type": "RollingUpdate"}, True),
        ({"type": "RollingUpdate", "maxUnavailable": 2}, True),
        ({"type": "RollingUpdate", "maxUnavailable": "25%"}, True),
        ({"type": "Recreate", "maxUnavailable": 1}, False),
        ({"maxUnavailable": 1}, True),  # type defaults to RollingUpdate first
    ],
    # dp x sp = devicesPerNode (issue 14); rules on the spec itself
    "self.devicesPerNode % self.sp == 0": [
        ({}, True),
        ({"devicesPerNode": 4, "sp": 2}, True),
        ({"devicesPerNode": 8, "sp": 8}, True),
        ({"devicesPerNode": 2}, True),
        ({"devicesPerNode": 3, "sp": 2}, False),
        ({"sp": 2}, False),  # devicesPerNode defaults to 1 first
        ({"devicesPerNode": 4, "sp": 8}, False),
    ],
    "self.sp == 1 || !has(self.engine) || !has(self.engine.kind) || self.engine.kind == 'dlo'": [
        ({}, True),
        ({"devicesPerNode": 2, "sp": 2}, True),
        ({"devicesPerNode": 2, "sp": 2, "engine": {"kind": "dlo"}}, True),
        ({"devicesPerNode": 2, "engine": {"kind": "vllm-omni"}}, True),
        ({"devicesPerNode": 2, "sp": 2, "engine": {"kind": "vllm-omni"}}, False),
    ],
    # the engine switches are typed fields (issue 26): rules on spec.engine and on the spec
    "self.kind == 'dlo' || (!has(self.gather) && !has(self.gatherMaxCtas) && !has(self.ulyssesExchange)"
    " && !has(self.registerEarly) && !has(self.maxDeviceMemory) && !has(self.streamDtype) && !has(self.cache))": [
        ({}, True),
        ({"gather": "collective", "registerEarly": False}, True),  # (the others need more devices: spec rules)
        ({"maxDeviceMemory": "24GiB", "streamDtype": "bfloat16"}, True),
        ({"cache": {"preset": "first-block", "threshold": 0.1}}, True),
        ({"kind": "vllm-omni", "cache": {"preset": "taylorseer"}}, False),
        ({"kind": "vllm-omni"}, True),
        ({"kind": "vllm-omni", "registerEarly": True}, False),
        ({"kind": "vllm-omni", "gather": "collective"}, False),
        ({"kind": "vllm-omni", "maxDeviceMemory": "24GiB"}, False),
        ({"kind": "vllm-omni", "streamDtype": "bfloat16"}, False),
    ],
    # the device budget (issue 27): an accelerator's
    "!has(self.maxDeviceMemory) || self.device != 'cpu'": [
        ({}, True),
        ({"device": "cpu"}, True),
        ({"maxDeviceMemory": "24GiB"}, True),
        ({"maxDeviceMemory": "25769803776", "device": "cuda"}, True),
        ({"maxDeviceMemory": "24GB", "device": "cpu"}, False),
    ],
    "!has(self.gatherMaxCtas) || self.device == 'auto' || self.device == 'cuda'": [
        ({}, True),
        ({"device": "cpu"}, True),
        ({"device": "cuda"}, True),
        ({"gatherMaxCtas": 4, "device": "cpu"}, False),
        ({"gatherMaxCtas": 4, "device": "npu"}, False),
    ],
    "!has(self.engine) || ((!has(self.engine.gather) || self.engine.gather == 'collective')"
    " && !has(self.engine.gatherMaxCtas)) || ((self.mode == 'auto' || self.mode == 'allgather')"
    " && self.devicesPerNode > 1)": [
        ({}, True),
        ({"engine": {"gather": "collective"}}, True),
        ({"devicesPerNode": 2, "engine": {"gather": "peer"}}, True),
        ({"devicesPerNode": 4, "mode": "allgather", "engine": {"gatherMaxCtas": 8}}, True),
        ({"engine": {"gather": "peer"}}, False),  # devicesPerNode defaults to 1 first
        ({"devicesPerNode": 2, "mode": "rank-local", "engine": {"gather": "peer"}}, False),
        ({"devicesPerNode": 2, "mode": "resident", "engine": {"gatherMaxCtas": 2}}, False),
    ],
    "!has(self.engine) || !has(self.engine.ulyssesExchange) || self.sp > 1": [
        ({}, True),
        ({"devicesPerNode": 2, "sp": 2, "engine": {"ulyssesExchange": "lean"}}, True),
        ({"engine": {"ulyssesExchange": "overlap"}}, False),
    ],
    "!(self.name in ['DLO_GATHER', 'DLO_GATHER_MAX_CTAS', 'DLO_ULYSSES', 'DLO_REGISTER_EARLY'])": [
        ({"name": "DLO_GATHERING", "value": "x"}, True),
        ({"name": "HF_HOME", "value": "/tmp/hf"}, True),
        ({"name": "DLO_GATHER", "value": "peer"}, False),
        ({"name": "DLO_REGISTER_EARLY", "value": "0"}, False),
    ],
    # spec.pod and spec.lora (issue 55)
    "!(self.name in ['model', 'model-cache', 'shm', 'tmp', 'videos', 'lora', 'api-keys'])": [
        ({"name": "certs", "secret": {"secretName": "ca"}}, True),
        ({"name": "models", "emptyDir": {}}, True),
        ({"name": "model", "emptyDir": {}}, False),
        ({"name": "tmp", "emptyDir": {}}, False),
        ({"name": "api-keys", "secret": {"secretName": "keys"}}, False),
    ],
    "!['/model', '/dev/shm', '/tmp', '/var/lib/dlo/videos', '/lora', '/etc/dlo/api-keys'].exists(p, "
    "self.mountPath == p || self.mountPath.startsWith(p + '/'))": [
        ({"name": "certs", "mountPath": "/etc/ssl/certs"}, True),
        ({"name": "extra", "mountPath": "/models"}, True),
        ({"name": "extra", "mountPath": "/model"}, False),
        ({"name": "extra", "mountPath": "/lora/more"}, False),
        ({"name": "extra", "mountPath": "/tmp/x"}, False),
        ({"name": "extra", "mountPath": "/etc/dlo/api-keys"}, False),
    ],
    # engine.apiKeys (issue 56: tenants)
    "!has(self.apiKeys) || !has(self.apiKeySecret)": [
        ({"apiKeys": {"secretName": "tenants"}}, True),
        ({"apiKeySecret": {"name": "key"}}, True),
        ({"apiKeys": {"secretName": "tenants"}, "apiKeySecret": {"name": "key"}}, False),
    ],
    "!has(self.apiKeys) || self.kind == 'dlo'": [
        ({"apiKeys": {"secretName": "tenants", "admins": ["ops"]}}, True),  # kind defaults to dlo
        ({"kind": "vllm-omni"}, True),
        ({"kind": "vllm-omni", "apiKeys": {"secretName": "tenants"}}, False),
    ],
    "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == "
    "m.name))": [
        ({}, True),
        ({"volumes": [{"name": "c", "emptyDir": {}}], "volumeMounts": [{"name": "c", "mountPath": "/c"}]}, True),
        ({"volumeMounts": [{"name": "c", "mountPath": "/c"}]}, False),
        ({"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": "c", "mountPath": "/c"}]}, False),
    ],
    "!('app.kubernetes.io/part-of' in self) && !('app.kubernetes.io/component' in self) && "
    "!('app.kubernetes.io/instance' in self) && !('app.kubernetes.io/managed-by' in self)": [
        ({"kueue.x-k8s.io/queue-name": "gpu"}, True),
        ({"app.kubernetes.io/instance": "other"}, False),
    ],
    "!('dlo.dev/template-hash' in self) && !('dlo.dev/mode' in self) && !('dlo.dev/model-key' in self) && "
    "!('dlo.dev/lora-key' in self)": [
        ({"sidecar.istio.io/inject": "false"}, True),
        ({"dlo.dev/mode": "resident"}, False),
        ({"dlo.dev/lora-key": "wan-0123456789ab"}, False),
    ],
    # spec.lora's source and uri rules are the model's (the cases above run at both places)
    "!has(self.subPath) || has(self.claimName)": [
        ({"claimName": "adapters", "subPath": "wan"}, True),
        ({"path": "/var/lib/lora", "subPath": "wan"}, False),
    ],
    "!has(self.lora) || !has(self.engine) || !has(self.engine.kind) || self.engine.kind == 'dlo'": [
        ({}, True),
        ({"lora": {"path": "/var/lib/lora"}}, True),
        ({"engine": {"kind": "vllm-omni"}}, True),
        ({"lora": {"path": "/var/lib/lora"}, "engine": {"kind": "vllm-omni"}}, False),
    ],
    "!has(self.lora) || !has(self.lora.uri) || !has(self.model.uri) || self.lora.uri != self.model.uri": [
        ({}, True),
        ({"lora": {"uri": "s3://adapters/wan"}}, True),
        ({"model": {"uri": "s3://models/wan"}, "lora": {"uri": "s3://models/wan-lora"}}, True),
        ({"model": {"uri": "s3://models/wan"}, "lora": {"claimName": "adapters"}}, True),
        ({"model": {"uri": "s3://models/wan"}, "lora": {"uri": "s3://models/wan"}}, False),
    ],
    "self.name != 'DLO_API_KEY' && self.name != 'VLLM_API_KEY'": [
        ({"name": "HF_HOME", "value": "/tmp/hf"}, True),
        ({"name": "DLO_API_KEY_FILE", "value": "/k"}, True),
        ({"name": "DLO_API_KEY", "value": "sk-123"}, False),
        ({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}, False),
    ],
}


def test_every_rule_of_the_crd_has_valid_and_invalid_cases():
    in_crd = {r["rule"] for _, r in RULES}
    assert in_crd == set(CASES), "a CEL rule without cases here (or cases for a rule gone from the CRD)"
    for rule, cases in CASES.items():
        assert {ok for _, ok in cases} == {True, False}, rule
    for _, r in RULES:
        assert r["message"], r  # the API server answers with it


@pytest.mark.parametrize("path, rule", [(p, r) for p, r in RULES], ids=[r["rule"] for _, r in RULES])
def test_each_rule_holds_exactly_on_its_valid_objects(path, rule):
    node = at(SPEC_SCHEMA, path)
    for value, ok in CASES[rule["rule"]]:
        assert evaluate(rule["rule"], defaulted(value, node)) is ok, (rule["rule"], value)


@pytest.mark.parametrize("path, rule", [(p, r) for p, r in RULES], ids=[r["rule"] for _, r in RULES])
def test_the_models_refuse_exactly_what_the_rule_refuses_with_its_message(path, rule):
    for value, ok in CASES[rule["rule"]]:
        spec = placed(path, value)
        if ok:
            parse_spec(json.loads(json.dumps(spec)))
        else:
            with pytest.raises(SpecError, match=re.escape(rule["message"])):
                parse_spec(json.loads(json.dumps(spec)))


def cel_verdict(spec: dict) -> list[str]:
    """The messages of the rules a spec breaks, as the API server would evaluate them."""
    full = defaulted(spec, SPEC_SCHEMA)
    broken = []
    for path, rule in RULES:
        if not all(evaluate(rule["rule"], value) for value in values_at(full, path)):
            broken.append(rule["message"])
    return broken


@EXAMPLES
@given(valid_specs())
def test_random_valid_specs_pass_every_rule(spec):
    assert cel_verdict(spec) == []


@EXAMPLES
@given(cel_breaking_specs())
def test_random_rule_breaking_specs_fail_the_rule_the_models_name(case):
    spec, _path = case
    assert schema_errors(spec) == []
    broken = cel_verdict(spec)
    assert broken
    with pytest.raises(SpecError) as refused:
        parse_spec(json.loads(json.dumps(spec)))
    assert all(message in str(refused.value) for message in broken)


def test_rules_on_list_items_read_only_bounded_lists_and_strings():
    """The API server refuses a CRD whose rules' estimated cost is too high, and estimates an
    unbounded list or string at a whole request's size: rules under a list read bounded values."""
    import re as _re

    for path, rule in RULES:
        if "[]" not in path:
            continue
        node = SPEC_SCHEMA
        for part in path:
            if part == "[]":
                assert node.get("maxItems"), (path, rule["rule"])
                node = node["items"]
            else:
                node = node["properties"][part]
        for field in set(_re.findall(r"self\.(\w+)", rule["rule"])):
            prop = node["properties"][field]
            assert prop.get("type") != "string" or prop.get("maxLength"), (path, field)
