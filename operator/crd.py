"""The DLODeployment CustomResourceDefinition, generated from the pydantic models of `models.py`.

Owns: turning pydantic's JSON schema into a Kubernetes structural schema (no $ref, no nulls,
int-or-string, maps), the printer columns, the scale and status subresources, and `build_crd()`
(what `dlo crd --write` writes to `crds/` and the chart's `crds/`).
Must never: define a field of the resource (the models do), talk to the API server or import torch.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from dlo.operator.models import (
    CRD_NAME,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    DLODeploymentSpec,
    DLODeploymentStatus,
)

def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Turn pydantic's JSON schema into a Kubernetes structural schema (no $ref, no nulls)."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    variants = node.pop("anyOf", None)
    if variants is not None:
        non_null = [v for v in variants if v.get("type") != "null"]
        types = {v.get("type") for v in non_null}
        if types == {"integer", "string"}:
            node["x-kubernetes-int-or-string"] = True
        elif len(non_null) == 1:
            node = {**non_null[0], **node}
        else:
            raise TypeError(f"cannot express {variants} in a structural schema")
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        return _structural({**target, **node}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "additionalProperties", "$defs") or (key == "default" and value is None):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            raise TypeError("exclusive bounds differ between JSON Schema and OpenAPI v3: use ge/le")
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        elif key == "const":  # a one-value Literal: Kubernetes schemas have enum, not const
            out["enum"] = [value]
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if out.get("type") == "object" and "properties" not in out:
        if isinstance(extra, dict) and (extra.get("type") or extra.get("x-kubernetes-int-or-string")):
            out["additionalProperties"] = _structural(extra, defs)  # a map: string, or a Quantity
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if "default" in out and isinstance(out["default"], (dict, list)) and not out["default"]:
        del out["default"]
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


# Printer columns of `kubectl get dlod` (-o wide adds priority 1).
COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "engine pods Ready"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "engine pods wanted"},
    {"name": "Up-to-date", "type": "integer", "jsonPath": ".status.updatedReplicas",
     "description": "engine pods on the current template"},
    {"name": "Mode", "type": "string", "jsonPath": ".status.mode", "description": "offload mode"},
    {"name": "Cached", "type": "number", "jsonPath": ".status.cachedRatio", "description": "page-cache residency"},
    {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
     "description": "reason of the Ready condition"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1,
     "description": "client Service URL inside the cluster"},
)
SUBRESOURCES = {
    "status": {},
    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
              "labelSelectorPath": ".status.selector"},
}


def spec_schema() -> dict[str, Any]:
    """The spec's structural schema; nested objects whose fields all have defaults (engine, warmer,
    ...) default to {} so that the API server fills their own defaults in; an optional object that
    is absent unless set (lora) gets no default."""
    schema = openapi_schema(DLODeploymentSpec)
    unset = {f.alias for f in DLODeploymentSpec.model_fields.values() if f.default is None}
    for name, prop in schema["properties"].items():
        if prop.get("type") == "object" and name not in schema.get("required", []) and name not in unset:
            prop["default"] = {}
    return schema


def resource_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the whole resource."""
    return {
        "type": "object",
        "description": "A Diffusion Transformer served with Distributed Layerwise Offload: one engine pod per node.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "dlo.dev/v1alpha1"},
            "kind": {"type": "string", "description": "DLODeployment"},
            "metadata": {"type": "object", "description": "standard object metadata"},
            "spec": spec_schema(),
            "status": openapi_schema(DLODeploymentStatus),
        },
    }


def names() -> dict[str, Any]:
    return {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
            "shortNames": SHORT_NAMES, "categories": ["dlo"]}


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of DLODeployment, generated from the models."""
    version = {
        "name": VERSION, "served": True, "storage": True,
        "schema": {"openAPIV3Schema": resource_schema()},
        "subresources": copy.deepcopy(SUBRESOURCES),
        "additionalPrinterColumns": [dict(c) for c in COLUMNS],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "dlo"}},
        "spec": {"group": GROUP, "scope": "Namespaced", "names": names(), "versions": [version]},
    }
