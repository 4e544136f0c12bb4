"""operator/models.py: the spec and status models, and the CRD generated from them."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from dlo.operator.cli import CRD_PATHS, crd_yaml
from dlo.operator.models import DLODeploymentSpec, SpecError, build_crd, parse_spec

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
    cols = [c["name"] for c in spec["versions"][0]["additionalPrinterColumns"]]
    assert cols == ["Ready", "Desired", "Mode", "Cached", "Age"]


def test_crd_schema_is_structural():
    for path, node in walk(crd_schema()):
        assert "$ref" not in node and "title" not in node, path
        assert "anyOf" not in node or node.get("x-kubernetes-int-or-string"), path
        if "properties" in node:
            assert node.get("type") == "object", path
            assert "additionalProperties" not in node, path


def test_crd_carries_the_cel_rules_the_models_check():
    props = crd_schema()["properties"]["spec"]["properties"]
    model_rules = [r["rule"] for r in props["model"]["x-kubernetes-validations"]]
    rollout_rules = [r["rule"] for r in props["rollout"]["x-kubernetes-validations"]]
    assert model_rules == ["has(self.path) != has(self.claimName)"]
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
        parse_spec({"model": {"path": "/m"}, "rollout": {"maxUnavailable": 1}})
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
    assert spec.rollout.type == "Recreate" and spec.service.port == 8000 and spec.warmer.threshold == 0.99
    assert spec.model.folder_name == "dev"


def test_mode_enums_and_the_facts_override_use_the_shared_vocabulary():
    from dlo.engine.facts import MODES, MODES_OR_AUTO, ModelFacts
    from dlo.operator.models import ModelFactsOverride

    schema = crd_schema()
    assert tuple(schema["properties"]["spec"]["properties"]["mode"]["enum"]) == MODES_OR_AUTO
    assert tuple(schema["properties"]["status"]["properties"]["mode"]["enum"]) == MODES
    spec = parse_spec({"model": {"path": "/models/wan", "facts": {"bytes": 10, "largestBlockBytes": 2}}})
    assert isinstance(spec.model.facts, ModelFactsOverride)
    assert spec.model.facts.facts() == ModelFacts(bytes=10, largest_block_bytes=2, blocks=1)
    with_blocks = ModelFactsOverride(bytes=10, largest_block_bytes=2, blocks=7)
    assert with_blocks.facts() == ModelFacts(bytes=10, largest_block_bytes=2, blocks=7)
