"""operator/models.py: the spec and status models, and the CRD generated from them."""

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dlo.operator.cli import CRD_PATHS, crd_yaml
from dlo.operator.crd import build_crd
from dlo.operator.models import DLODeploymentSpec, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]


def crd_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}/{i}")


@pytest.mark.parametrize("rel", CRD_PATHS, ids=str)
def test_checked_in_crd_is_generated_from_the_models(rel):
    path = ROOT / rel
    assert path.read_text() == crd_yaml(), f"{rel} is stale: run `dlo crd --write`"


def test_crd_declares_scale_subresource_on_spec_replicas_with_status_selector():
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_crd_names_and_printer_columns():
    spec = build_crd()["spec"]
    assert spec["group"] == "dlo.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["plural"] == "dlodeployments" and spec["names"]["shortNames"] == ["dlod"]
    columns = {c["name"]: c for c in spec["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Desired", "Up-to-date", "Mode", "Cached", "Status", "Age", "URL"]
    assert columns["Up-to-date"]["jsonPath"] == ".status.updatedReplicas"
    assert columns["Status"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert columns["URL"]["jsonPath"] == ".status.url" and columns["URL"]["priority"] == 1  # -o wide
    status = crd_schema()["properties"]["status"]["properties"]
    for column in columns.values():  # every column reads a field the schema declares
        path = column["jsonPath"].split("[")[0].strip(".").split(".")
        if path[0] == "status":
            assert path[1] in status, column


def test_every_property_of_the_crd_has_a_description():
    """`kubectl explain dlod.spec` (and every field below it, status too) explains."""
    missing = []
    for path, node in walk(crd_schema()):
        for name, prop in node.get("properties", {}).items() if isinstance(node.get("properties"), dict) else ():
            if not prop.get("description", "").strip():
                missing.append(f"{path}/properties/{name}")
    assert missing == []
    props = crd_schema()["properties"]
    assert len(list(walk(props["spec"]))) > 100  # the Kubernetes types are inlined, with their descriptions


def test_conditions_are_a_list_map_keyed_by_type():
    conditions = crd_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]  # a list-map key must be required
    assert crd_schema()["properties"]["status"]["properties"]["url"]["type"] == "string"


def test_crd_is_strictly_valid_kubernetes():
    kubernetes_validate.validate(build_crd(), "1.37.0", strict=True)


def schema_nodes(node, path=""):
    """Every schema node (not the maps of property names, rule lists or enums)."""
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from schema_nodes(node[key], f"{path}[{key}]")


def test_crd_schema_is_structural():
    for path, node in walk(crd_schema()):
        assert "$ref" not in node and "title" not in node, path
        assert "anyOf" not in node or node.get("x-kubernetes-int-or-string"), path
        if "properties" in node:
            assert node.get("type") == "object", path
            assert "additionalProperties" not in node, path
    scalar = {"string", "integer", "number", "boolean"}
    for path, node in schema_nodes(crd_schema()):
        # a type on every node, except int-or-string (which must have none) and preserved objects
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        else:
            assert node.get("type") in scalar | {"object", "array"}, path
        assert node.get("format") in (None, "int32", "int64", "double", "float", "byte", "date-time"), path
        if node.get("type") == "array":
            assert "items" in node, path
        list_type = node.get("x-kubernetes-list-type")
        if list_type == "map":  # keys: required (or defaulted) scalar fields of the items
            items = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in items.get("required", []) or "default" in items["properties"][key], (path, key)
                assert items["properties"][key]["type"] in scalar, (path, key)
        elif list_type == "set":
            assert node["items"].get("type") in scalar, path
        else:
            assert "x-kubernetes-list-map-keys" not in node, path


def test_crd_carries_the_cel_rules_the_models_check():
    props = crd_schema()["properties"]["spec"]["properties"]
    model_rules = [r["rule"] for r in props["model"]["x-kubernetes-validations"]]
    rollout_rules = [r["rule"] for r in props["rollout"]["x-kubernetes-validations"]]
    assert model_rules == ["(has(self.path) ? 1 : 0) + (has(self.claimName) ? 1 : 0) + (has(self.uri) ? 1 : 0) == 1",
                           "has(self.uri) || (!has(self.secretRef) && !has(self.endpoint))"]
    assert rollout_rules == ["!has(self.maxUnavailable) || self.type == 'RollingUpdate'"]


def test_crd_schema_enums_and_ranges():
    props = crd_schema()["properties"]["spec"]["properties"]
    assert props["mode"]["enum"] == ["auto", "allgather", "rank-local", "resident"]
    assert props["engine"]["properties"]["device"]["enum"] == ["auto", "cuda", "npu", "cpu"]
    assert props["warmer"]["properties"]["threshold"]["minimum"] == 0
    assert props["warmer"]["properties"]["threshold"]["maximum"] == 1
    assert props["devicesPerNode"]["minimum"] == 1
    assert crd_schema()["properties"]["spec"]["required"] == ["model"]


def example_resources():
    docs = yaml.safe_load_all((ROOT / "examples" / "dlodeployment.yaml").read_text())
    return [d for d in docs if d and d["kind"] == "DLODeployment"]


def test_example_is_valid_against_the_crd_schema_and_the_models():
    (res,) = example_resources()
    jsonschema.validate(res, crd_schema())
    spec = parse_spec(res["spec"])
    assert spec.devices_per_node == 8 and spec.model.folder_name == "wan2.1-14b"


def test_fetched_model_example_is_valid_and_renders_fetch_placement_and_autoscaling():
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "dlodeployment-fetched.yaml").read_text()) if d]
    (res,) = [d for d in docs if d["kind"] == "DLODeployment"]
    jsonschema.validate(res, crd_schema())
    spec = parse_spec(res["spec"])
    assert spec.model.served_name == "wan2.1-t2v-14b-diffusers" and spec.model.cache_key
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def test_crd_schema_rejects_wrong_types_and_ranges():
    (res,) = example_resources()
    bad = json.loads(json.dumps(res))
    bad["spec"]["warmer"]["threshold"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema())
    bad = json.loads(json.dumps(res))
    bad["spec"]["mode"] = "fastest"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema())


@pytest.mark.parametrize(
    "model",
    [{}, {"path": "/m", "claimName": "c"}],
    ids=["neither", "both"],
)
def test_model_source_needs_exactly_one_of_path_and_claim(model):
    with pytest.raises(SpecError, match="exactly one of model.path"):
        parse_spec({"model": model})


def test_max_unavailable_only_with_rolling_update():
    with pytest.raises(SpecError, match="only allowed with rollout.type RollingUpdate"):
        parse_spec({"model": {"path": "/m"}, "rollout": {"type": "Recreate", "maxUnavailable": 1}})
    assert parse_spec({"model": {"path": "/m"}, "rollout": {"maxUnavailable": 2}}).rollout.type == "RollingUpdate"
    spec = parse_spec({"model": {"path": "/m"}, "rollout": {"type": "RollingUpdate", "maxUnavailable": "50%"}})
    assert spec.rollout.max_unavailable == "50%"
    with pytest.raises(SpecError, match="percentage"):
        parse_spec({"model": {"path": "/m"}, "rollout": {"type": "RollingUpdate", "maxUnavailable": "half"}})


def test_spec_error_names_the_field():
    with pytest.raises(SpecError) as err:
        parse_spec({"model": {"path": "/m"}, "devicesPerNode": 0, "warmer": {"threshold": 2}})
    assert "spec.devicesPerNode" in str(err.value) and "spec.warmer.threshold" in str(err.value)


def test_unknown_fields_are_rejected():
    with pytest.raises(SpecError, match="spec.replica"):
        parse_spec({"model": {"path": "/m"}, "replica": 3})


def test_defaults_and_folder_name():
    spec = DLODeploymentSpec.model_validate({"model": {"claimName": "models", "subPath": "flux/dev/"}})
    assert spec.mode == "auto" and spec.replicas == 1 and spec.accelerator_resource == "nvidia.com/gpu"
    assert spec.rollout.type == "RollingUpdate" and spec.service.port == 8000 and spec.warmer.threshold == 0.99
    assert spec.model.folder_name == "dev"


def test_mode_enums_and_the_facts_override_use_the_shared_vocabulary():
    from dlo.plan.facts import MODES, MODES_OR_AUTO, ModelFacts
    from dlo.operator.models import ModelFactsOverride

    schema = crd_schema()
    assert tuple(schema["properties"]["spec"]["properties"]["mode"]["enum"]) == MODES_OR_AUTO
    assert tuple(schema["properties"]["status"]["properties"]["mode"]["enum"]) == MODES
    spec = parse_spec({"model": {"path": "/models/wan", "facts": {"bytes": 10, "largestBlockBytes": 2}}})
    assert isinstance(spec.model.facts, ModelFactsOverride)
    assert spec.model.facts.facts() == ModelFacts(bytes=10, largest_block_bytes=2, blocks=1)
    with_blocks = ModelFactsOverride(bytes=10, largest_block_bytes=2, blocks=7)
    assert with_blocks.facts() == ModelFacts(bytes=10, largest_block_bytes=2, blocks=7)


# ---- the Kubernetes types inside the spec ------------------------------------------------------

TYPOS = {
    "limts": ({"engine": {"resources": {"limts": {"cpu": "1"}}}}, "spec.engine.resources.limts"),
    "nmae": ({"engine": {"env": [{"nmae": "A", "value": "b"}]}}, "spec.engine.env.0.nmae"),
    "nodeAfinity": ({"placement": {"affinity": {"nodeAfinity": {}}}}, "spec.placement.affinity.nodeAfinity"),
    "tolerationSecond": (
        {"placement": {"tolerations": [{"key": "k", "operator": "Exists", "tolerationSecond": 5}]}},
        "spec.placement.tolerations.0.tolerationSecond",
    ),
    "deep": (
        {"placement": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpression": []}]}}}}},
        "spec.placement.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0"
        ".matchExpression",
    ),
}


@pytest.mark.parametrize("case", TYPOS)
def test_typos_in_kubernetes_types_are_refused_by_the_models_naming_the_field(case):
    spec, field = TYPOS[case]
    with pytest.raises(SpecError) as refused:
        parse_spec({"model": {"path": "/m"}, **spec})
    assert f"{field}: unknown field" in str(refused.value)


@pytest.mark.parametrize("case", TYPOS)
def test_typos_in_kubernetes_types_are_refused_by_the_crd_schema_naming_the_field(case):
    from test_models_fuzz import schema_errors  # the CRD schema as the API server applies it

    spec, field = TYPOS[case]
    errors = schema_errors({"model": {"path": "/m"}, **spec})
    unknown = field.rsplit(".", 1)[-1]
    assert any(unknown in e and "Additional properties" in e for e in errors), errors


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"engine": {"resources": {"limits": {"memory": "8 GB"}}}}, "spec.engine.resources.limits.memory: '8 GB' is not a quantity"),
        ({"engine": {"resources": {"limits": {"cpu": True}}}}, "spec.engine.resources.limits.cpu: must be an integer or a string"),
        ({"engine": {"env": [{"value": "x"}]}}, "spec.engine.env.0: required field 'name' is missing"),
        ({"engine": {"env": {"A": "b"}}}, "spec.engine.env: must be a list"),
        ({"placement": {"tolerations": [{"tolerationSeconds": "5"}]}}, "spec.placement.tolerations.0.tolerationSeconds: must be an integer"),
        ({"placement": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}}},
         "required field 'nodeSelectorTerms' is missing"),
        ({"engine": {"env": [{"name": f"V{i}"} for i in range(257)]}}, "spec.engine.env: more than 256 items"),
        ({"engine": {"env": [{"name": "V" * 1025}]}}, "spec.engine.env.0.name: longer than 1024 characters"),
    ],
    ids=["quantity", "bool-quantity", "env-no-name", "env-map", "string-seconds", "no-terms", "env-count",
         "env-name-length"],
)
def test_kubernetes_types_are_checked_for_types_quantities_and_required_fields(spec, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec({"model": {"path": "/m"}, **spec})


def test_valid_kubernetes_types_pass_unchanged():
    raw = {
        "model": {"path": "/m"},
        "engine": {
            "env": [{"name": "A", "value": "b"}, {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
            "resources": {"requests": {"cpu": "500m", "memory": "64Gi"}, "limits": {"memory": 68719476736}},
        },
        "placement": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        },
    }
    spec = parse_spec(json.loads(json.dumps(raw)))
    assert spec.engine.env == raw["engine"]["env"] and spec.engine.resources == raw["engine"]["resources"]
    assert spec.placement.affinity == raw["placement"]["affinity"]
    from test_models_fuzz import schema_errors

    assert schema_errors(raw) == []


def test_kubernetes_schemas_are_extracted_from_the_upstream_definitions():
    """operator/k8s_schemas.json is what `python -m dlo.operator.k8s_schemas` makes from the
    Kubernetes OpenAPI definitions (bundled with kubernetes-validate): not stale, not hand-edited."""
    from dlo.operator import k8s_schemas

    assert json.loads(k8s_schemas.SCHEMA_FILE.read_text()) == k8s_schemas.extract()


def test_engine_image_defaults_to_the_operators_default():
    from dlo.operator.models import DEFAULT_IMAGE, default_engine_image, with_default_image

    spec = parse_spec({"model": {"path": "/m"}})
    assert spec.engine.image is None
    assert "default" not in crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["image"]
    assert default_engine_image({}) == DEFAULT_IMAGE
    assert default_engine_image({"DLO_DEFAULT_ENGINE_IMAGE": "reg/dlo:2"}) == "reg/dlo:2"
    assert with_default_image(spec, "reg/dlo:2").engine.image == "reg/dlo:2"
    named = parse_spec({"model": {"path": "/m"}, "engine": {"image": "mine:1"}})
    assert with_default_image(named, "reg/dlo:2").engine.image == "mine:1"  # the spec wins
