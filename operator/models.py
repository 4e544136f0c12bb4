"""The DLODeployment resource: its spec and status as pydantic models, and the CRD made from them.

Owns: the schema of `dlo.dev/v1alpha1` `DLODeployment` (single source: `crds/` and the chart's
`crds/` are generated from these models by `dlo crd --write`), the cross-field rules (checked here
in Python and, the same rules, as CEL `x-kubernetes-validations` in the CRD), and `build_crd()`.
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from dlo.engine.facts import Mode, ModelFacts, ModeOrAuto

GROUP = "dlo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DLODeployment"
PLURAL = "dlodeployments"
SINGULAR = "dlodeployment"
SHORT_NAMES = ["dlod"]
CRD_NAME = f"{PLURAL}.{GROUP}"

DEFAULT_IMAGE = "ghcr.io/dlo-dev/dlo:0.1.0"
API_KEY_ENV = "DLO_API_KEY"  # the engine reads its API key from this variable


class SpecError(ValueError):
    """A DLODeployment spec the operator cannot act on; the message says what to fix."""


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    """CEL rules for the CRD (`x-kubernetes-validations`); the same rule is checked in Python."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True
    )


class ModelFactsOverride(_Model):
    """`spec.model.facts`: model facts that override what node profiles report (bytes in base units).

    The user-facing form of `dlo.engine.facts.ModelFacts` (camelCase, `blocks` optional);
    `facts()` is the one conversion.
    """

    bytes: int = Field(ge=1, description="safetensors bytes of the transformer")
    largest_block_bytes: int = Field(ge=1, description="bytes of the largest block in the slot layout")
    blocks: int | None = Field(None, ge=1, description="number of blocks (optional)")

    def facts(self) -> ModelFacts:
        """The model facts the policy takes (`blocks` defaults to 1: it only informs)."""
        return ModelFacts(bytes=self.bytes, largest_block_bytes=self.largest_block_bytes, blocks=self.blocks or 1)


_MODEL_SOURCE_RULE = (
    "has(self.path) != has(self.claimName)",
    "set exactly one of model.path (hostPath) and model.claimName (PersistentVolumeClaim)",
)


class ModelSource(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(_MODEL_SOURCE_RULE))

    path: str | None = Field(
        None, min_length=1, description="hostPath of a diffusers-format folder, mounted read-only"
    )
    claim_name: str | None = Field(None, min_length=1, description="PersistentVolumeClaim holding the model")
    sub_path: str = Field("", description="folder of the model inside the claim")
    facts: ModelFactsOverride | None = Field(None, description="override the model facts node profiles report")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.path is None) == (self.claim_name is None):
            raise ValueError(_MODEL_SOURCE_RULE[1])
        return self

    @property
    def folder_name(self) -> str:
        """The model's folder name: the key of its facts in a node profile's `models`."""
        where = self.path if self.path is not None else (self.sub_path or self.claim_name or "")
        return where.rstrip("/").rsplit("/", 1)[-1]


class SecretKeyRef(_Model):
    name: str = Field(min_length=1)
    key: str = Field("api-key", min_length=1)


class EngineSpec(_Model):
    kind: Literal["dlo", "vllm-omni"] = "dlo"
    image: str = Field(DEFAULT_IMAGE, min_length=1)
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    args: list[str] = Field(default_factory=list, description="extra arguments for the engine")
    env: list[dict[str, Any]] = Field(default_factory=list, description="extra core/v1 EnvVar items")
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="core/v1 ResourceRequirements; the accelerator limit is added from devicesPerNode",
    )
    api_key_secret: SecretKeyRef | None = Field(None, description="Secret key exposed as DLO_API_KEY")
    shm_size: str | None = Field(None, description="size of /dev/shm; default 1Gi per rank")
    pin_memory_lock: bool = Field(
        False, description="grant IPC_LOCK (only when pinning must mlock beyond the memlock limit)"
    )

    @model_validator(mode="after")
    def _api_key_only_from_a_secret(self) -> EngineSpec:
        # The one rule only the operator checks (env items are free-form in the CRD): a key set
        # here would be written into the StatefulSet's pod template for anyone who reads it.
        if any(e.get("name") == API_KEY_ENV for e in self.env):
            raise ValueError(
                f"engine.env must not set {API_KEY_ENV}: put the key in a Secret and name it in engine.apiKeySecret"
            )
        return self


class WarmerSpec(_Model):
    enabled: bool = True
    threshold: float = Field(0.99, ge=0, le=1, description="page-cache residency to reach, 0..1")
    image: str | None = Field(None, description="default: the engine image")


class PlacementSpec(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    affinity: dict[str, Any] = Field(default_factory=dict, description="core/v1 Affinity")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="core/v1 Toleration items")
    priority_class_name: str | None = None


_ROLLOUT_RULE = (
    "!has(self.maxUnavailable) || self.type == 'RollingUpdate'",
    "rollout.maxUnavailable is only allowed with rollout.type RollingUpdate",
)


# 1% to 100%: "0%" would be a rollout that never moves. In the CRD as `pattern` (strings) and
# `minimum` (integers) on the int-or-string field: plain schema checks, no CEL cost.
_PERCENT = r"^([1-9][0-9]?|100)%$"


class RolloutSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(_ROLLOUT_RULE))

    type: Literal["Recreate", "RollingUpdate"] = "Recreate"
    max_unavailable: int | str | None = Field(
        None,
        description="pods (or a percentage) down at once during a RollingUpdate; never surges",
        json_schema_extra={"minimum": 1, "pattern": _PERCENT},
    )

    @model_validator(mode="after")
    def _unavailable_only_rolling(self) -> RolloutSpec:
        if self.max_unavailable is not None and self.type != "RollingUpdate":
            raise ValueError(_ROLLOUT_RULE[1])
        if isinstance(self.max_unavailable, int) and self.max_unavailable < 1:
            raise ValueError("rollout.maxUnavailable must be at least 1")
        if isinstance(self.max_unavailable, str) and not re.fullmatch(_PERCENT, self.max_unavailable):
            raise ValueError("rollout.maxUnavailable must be an integer or a percentage from 1% to 100% like '25%'")
        return self


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535, description="Service port; the engine listens on it too")


class MonitoringSpec(_Model):
    enabled: bool = Field(False, description="create a PodMonitor/ServiceMonitor (when its CRD exists)")
    kind: Literal["PodMonitor", "ServiceMonitor"] = "PodMonitor"
    labels: dict[str, str] = Field(default_factory=dict, description="labels your Prometheus selects")
    interval: str = "15s"


class DLODeploymentSpec(_Model):
    model: ModelSource
    replicas: int = Field(1, ge=0, description="nodes: one engine pod per node")
    devices_per_node: int = Field(1, ge=1, description="data-parallel ranks per node (dp)")
    accelerator_resource: str = Field("nvidia.com/gpu", min_length=1)
    mode: ModeOrAuto = "auto"
    engine: EngineSpec = Field(default_factory=EngineSpec)
    warmer: WarmerSpec = Field(default_factory=WarmerSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)


class Condition(_Model):
    """metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = None
    last_transition_time: str
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""


class NodeStatus(_Model):
    name: str
    phase: str = "Unknown"
    cached_ratio: float | None = Field(None, ge=0, le=1)


class DLODeploymentStatus(_Model):
    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: str = ""
    mode: Mode | None = None
    mode_reason: str = ""
    mode_inputs: str = Field("", description="digest of what the mode was decided from")
    cached_ratio: float | None = Field(None, ge=0, le=1, description="lowest page-cache residency over nodes")
    nodes: list[NodeStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)


def parse_spec(spec: dict[str, Any]) -> DLODeploymentSpec:
    """Validate a spec as the API server would (schema and CEL rules); raise SpecError naming fields."""
    try:
        # strict: no coercion the API server would not do ("3" is not an integer, "yes" no boolean)
        return DLODeploymentSpec.model_validate(spec, strict=True)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "spec"
            problems.append(f"spec.{where}: {err['msg']}")
        raise SpecError("; ".join(problems)) from None


# ---- CRD generation --------------------------------------------------------------------------


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
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if out.get("type") == "object" and "properties" not in out:
        if isinstance(extra, dict) and extra.get("type") == "string":
            out["additionalProperties"] = {"type": "string"}
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if "default" in out and isinstance(out["default"], (dict, list)) and not out["default"]:
        del out["default"]
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of DLODeployment, generated from the models above."""
    spec_schema = openapi_schema(DLODeploymentSpec)
    status_schema = openapi_schema(DLODeploymentStatus)
    # Nested objects with all-default fields (engine, warmer, ...) default to {} so that the API
    # server fills their own defaults in.
    for name, prop in spec_schema["properties"].items():
        if prop.get("type") == "object" and name not in spec_schema.get("required", []):
            prop["default"] = {}
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
        {"name": "Cached", "type": "number", "jsonPath": ".status.cachedRatio"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "dlo"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["dlo"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A Diffusion Transformer served with Distributed Layerwise "
                            "Offload: one engine pod per node.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }
