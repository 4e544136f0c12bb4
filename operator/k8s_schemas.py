"""Kubernetes core/v1 schemas for the pass-through fields of a DLODeployment, and a checker for them.

Owns: the structural schemas of `EnvVar`, `ResourceRequirements`, `Affinity`, `Toleration`, `Volume`,
`VolumeMount` and `LocalObjectReference` as Kubernetes itself defines them (`k8s_schemas.json`, extracted from the upstream OpenAPI
definitions of the Kubernetes version in that file by `python -m dlo.operator.k8s_schemas`, which
reads the definitions kubernetes-validate bundles; a test fails when the file is stale), and
`check`, which validates a value against one of them the way the API server applies a CRD's
structural schema under strict field validation: unknown fields, wrong types, missing required
fields and malformed quantities are errors, each with the path of the field.
Must never: talk to the API server or import torch; the operator needs no extra package for it.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

SCHEMA_FILE = Path(__file__).with_name("k8s_schemas.json")
KUBERNETES_VERSION = "1.37.0"  # whose OpenAPI definitions k8s_schemas.json holds
KINDS = ("EnvVar", "ResourceRequirements", "Affinity", "Toleration", "Volume", "VolumeMount", "LocalObjectReference")
# resource.Quantity as CRD generators write it (an integer or a string of this form).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
_KEEP = {
    "type", "description", "properties", "required", "items", "additionalProperties", "format", "enum",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type",
}

Problem = tuple[str, str]  # (dotted path below the checked field, what is wrong)


def structural(definitions: dict[str, Any], name: str) -> dict[str, Any]:
    """The upstream definition `name` as a CRD structural schema: references inlined, nullable
    types narrowed to their type, Quantity as an integer-or-string with its pattern."""
    if name == _QUANTITY:
        return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}
    return _node(definitions, definitions[name])


def _node(definitions: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = structural(definitions, node["$ref"].rsplit("/", 1)[-1])
        return {**target, **({"description": node["description"]} if "description" in node else {})}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue
        if key == "type" and isinstance(value, list):
            (value,) = [t for t in value if t != "null"]
        if key == "properties":
            value = {k: _node(definitions, v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _node(definitions, value)
        out[key] = value
    return out


def extract(version: str = KUBERNETES_VERSION) -> dict[str, Any]:
    """The schemas of KINDS from the definitions bundled with kubernetes-validate (a dev tool)."""
    import kubernetes_validate

    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local" / "_definitions.json"
    definitions = json.loads(path.read_text())["$defs"]
    return {
        "kubernetes": version,
        "schemas": {kind: structural(definitions, f"io.k8s.api.core.v1.{kind}") for kind in KINDS},
    }


@functools.cache
def _load() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())["schemas"]


def schema(kind: str) -> dict[str, Any]:
    """A copy of the structural schema of core/v1 `kind` (one of KINDS)."""
    return copy.deepcopy(_load()[kind])


def _type_ok(value: Any, node: dict[str, Any]) -> str | None:
    """None when `value` has the node's JSON type, else the expected type's name."""
    if node.get("x-kubernetes-int-or-string"):
        ok = (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
        return None if ok else "an integer or a string"
    kind = node.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    }
    if kind is None or checks[kind](value):
        return None
    return {"object": "an object", "array": "a list", "integer": "an integer"}.get(kind, f"a {kind}")


def check(value: Any, node: dict[str, Any], path: str = "") -> list[Problem]:
    """Every way `value` breaks the structural schema `node`, as (path, problem)."""
    expected = _type_ok(value, node)
    if expected is not None:
        return [(path, f"must be {expected}, not {type(value).__name__} {json.dumps(value)[:40]}")]
    problems: list[Problem] = []
    if isinstance(value, str):
        if "enum" in node and value not in node["enum"]:
            problems.append((path, f"must be one of {', '.join(map(str, node['enum']))}"))
        if "maxLength" in node and len(value) > node["maxLength"]:
            problems.append((path, f"longer than {node['maxLength']} characters"))
        if "pattern" in node and not re.search(node["pattern"], value):
            what = "a quantity like 500m, 8Gi or 2" if node["pattern"] == QUANTITY_PATTERN else node["pattern"]
            problems.append((path, f"{value!r} is not {what}"))
    if isinstance(value, dict):
        props = node.get("properties")
        if props is not None:
            for key in value:
                if key not in props:
                    where = f"{path}.{key}" if path else key
                    problems.append((where, f"unknown field {key!r} (known: {', '.join(sorted(props))})"))
            for key in node.get("required", []):
                if key not in value:
                    problems.append((path, f"required field {key!r} is missing"))
            for key, sub in value.items():
                if key in props:
                    problems += check(sub, props[key], f"{path}.{key}" if path else key)
        elif isinstance(node.get("additionalProperties"), dict):
            for key, sub in value.items():
                problems += check(sub, node["additionalProperties"], f"{path}.{key}" if path else key)
    if isinstance(value, list) and "maxItems" in node and len(value) > node["maxItems"]:
        problems.append((path, f"more than {node['maxItems']} items"))
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            problems += check(item, node["items"], f"{path}.{i}" if path else str(i))
    return problems


def _undescribe(node: dict[str, Any], levels: int, note: str) -> None:
    """The descriptions of the fields more than `levels` below `node` replaced by `note`."""
    for sub in (node.get("properties") or {}).values():
        if levels <= 0:
            sub["description"] = note
        _undescribe(sub, levels - 1, note)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _undescribe(node[key], levels, note)


def cel_rules(*rules: tuple[str, str]) -> dict[str, Any]:
    """CEL rules for the CRD (`x-kubernetes-validations`); the same rule is checked in Python."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


def kubernetes_field(
    kind: str,
    *,
    many: bool = False,
    description: str,
    item_rules: tuple[tuple[str, str], ...] = (),
    max_items: int | None = None,
    name_max_length: int | None = None,
    max_lengths: dict[str, int] | None = None,
    described_levels: int | None = None,
) -> Any:
    """A pass-through field checked against the Kubernetes schema of core/v1 `kind`: the CRD
    carries that schema (so the API server refuses `limts`), and pydantic checks the same schema
    with `k8s_schemas.check` (so `dlo operator render` and the operator refuse it too).
    `item_rules`: CEL rules on each item (the models check them in a validator of their own);
    `max_items` and `name_max_length` bound the list and its items' `name`, which keeps the API
    server's cost estimate of those rules small (unbounded, it assumes a request's worth);
    `max_lengths` bounds other string fields of the item the same way; `described_levels` keeps the
    descriptions of that many levels of fields only, the deeper ones point to the API reference (a
    Volume with every source described is 80 KB)."""
    node = schema(kind)
    node.pop("description", None)
    if described_levels is not None:
        _undescribe(node, described_levels, f"as in core/v1 {kind} (the Kubernetes API reference describes it)")
    if item_rules:
        node.update(cel_rules(*item_rules))
    for field, length in {**({"name": name_max_length} if name_max_length else {}), **(max_lengths or {})}.items():
        node["properties"][field]["maxLength"] = length
    if many:
        node = {"type": "array", "items": node}
        if max_items is not None:
            node["maxItems"] = max_items
    node["description"] = description

    def validate(value: Any) -> Any:
        problems = check(value, node)
        if problems:
            text = "; ".join(f"{where}: {what}" if where else what for where, what in problems)
            raise PydanticCustomError("kubernetes_schema", "{text}", {"text": text, "problems": problems})
        return copy.deepcopy(value)

    return Annotated[list[dict[str, Any]] if many else dict[str, Any], PlainValidator(validate), WithJsonSchema(node)]

if __name__ == "__main__":  # python -m dlo.operator.k8s_schemas > operator/k8s_schemas.json
    json.dump(extract(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
