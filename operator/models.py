"""The DLODeployment resource: its spec and status as pydantic models.

Owns: the schema of `dlo.dev/v1alpha1` `DLODeployment` (single source: `crds/` and the chart's
`crds/` are generated from these models by `dlo crd --write`, see `dlo.operator.crd`), and the
cross-field rules (checked here in Python and, the same rules, as CEL `x-kubernetes-validations`).
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from dlo.plan.facts import ModeOrAuto
from dlo.operator.engine_spec import (
    API_KEY_ENV,
    ENGINE_SWITCH_ENV,
    VLLM_API_KEY_ENV,
    VLLM_OMNI_REFUSED_FLAGS,
    EngineSpec,
    SecretKeyRef,
)
from dlo.operator.k8s_schemas import cel_rules, kubernetes_field
from dlo.operator.model_spec import ModelFactsOverride, ModelSecretRef, ModelSource
from dlo.operator.pod_spec import EnginePodSpec, LoraSource
from dlo.operator.scaling_spec import AutoscalingSpec, VideosSpec
from dlo.operator.spec_base import SpecModel as _Model
from dlo.operator.status_models import Condition, DLODeploymentStatus, NodeStatus

__all__ = [
    "API_KEY_ENV", "API_VERSION", "CRD_NAME", "DEFAULT_IMAGE", "DEFAULT_IMAGE_ENV", "ENGINE_SWITCH_ENV", "GROUP",
    "KIND", "PLURAL", "SHORT_NAMES", "SINGULAR", "VERSION", "VLLM_API_KEY_ENV", "VLLM_OMNI_REFUSED_FLAGS",
    "Condition", "DLODeploymentSpec", "DLODeploymentStatus", "EngineSpec", "ModelFactsOverride", "ModelSecretRef",
    "ModelSource",
    "NodeStatus", "SecretKeyRef", "SpecError", "default_engine_image", "parse_spec", "with_default_image",
]

GROUP = "dlo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DLODeployment"
PLURAL = "dlodeployments"
SINGULAR = "dlodeployment"
SHORT_NAMES = ["dlod"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# The engine image when spec.engine.image is unset: the operator's environment (the chart sets it),
# else this one.
DEFAULT_IMAGE_ENV = "DLO_DEFAULT_ENGINE_IMAGE"
DEFAULT_IMAGE = "ghcr.io/dlo-dev/dlo:0.1.0"


class SpecError(ValueError):
    """A DLODeployment spec the operator cannot act on; the message says what to fix."""


def default_engine_image(environ: Mapping[str, str]) -> str:
    """The engine image for specs that name none: `DLO_DEFAULT_ENGINE_IMAGE`, else DEFAULT_IMAGE."""
    return environ.get(DEFAULT_IMAGE_ENV) or DEFAULT_IMAGE


class WarmerSpec(_Model):
    """An init container that runs `dlo warm /model` so the page cache is hot before the engine starts."""

    enabled: bool = Field(True, description="run the warmer init container")
    threshold: float = Field(0.99, ge=0, le=1, description="page-cache residency to reach, 0..1")
    image: str | None = Field(None, description="warmer image; default: the engine image")
    resources: kubernetes_field(  # type: ignore[valid-type]
        "ResourceRequirements",
        description="compute resources of the warmer (core/v1 ResourceRequirements), over its defaults "
        "(requests cpu 250m, memory 256Mi; no memory limit: the page cache it faults in is the pod's)",
    ) = Field(default_factory=dict)


class PlacementSpec(_Model):
    """Where the engine pods may run; merged into the pod (one pod per node is always added)."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels the pods require")
    affinity: kubernetes_field(  # type: ignore[valid-type]
        "Affinity",
        description="scheduling affinity of the pods (core/v1 Affinity); a required pod anti-affinity on "
        "kubernetes.io/hostname is always added",
    ) = Field(default_factory=dict)
    tolerations: kubernetes_field(  # type: ignore[valid-type]
        "Toleration", many=True, description="taints the pods tolerate (core/v1 Toleration)"
    ) = Field(default_factory=list)
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods")
    model_affinity: Literal["required", "preferred"] = Field(
        "required",
        description="model.uri: pods go only to nodes that hold the model (required), or prefer them and fetch "
        "it in an init container elsewhere (preferred)",
    )


_ROLLOUT_RULE = (
    "!has(self.maxUnavailable) || self.type == 'RollingUpdate'",
    "rollout.maxUnavailable is only allowed with rollout.type RollingUpdate",
)


# 1% to 100%: "0%" would be a rollout that never moves. In the CRD as `pattern` (strings) and
# `minimum` (integers) on the int-or-string field: plain schema checks, no CEL cost.
_PERCENT = r"^([1-9][0-9]?|100)%$"


class RolloutSpec(_Model):
    """How pods move to a new template (a new plan, image or spec). Never surges: accelerator
    nodes have no spare capacity. RollingUpdate (the default) keeps every pod but `maxUnavailable`
    serving; Recreate is an outage: every pod on an old template goes at once."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_ROLLOUT_RULE))

    type: Literal["Recreate", "RollingUpdate"] = Field(
        "RollingUpdate",
        description="RollingUpdate (default): the StatefulSet replaces maxUnavailable pods at a time (1 unless "
        "set), each replacement ready (the engine's /ready) before the next pod goes; Recreate: the operator "
        "deletes every pod on an old template at once (StatefulSet OnDelete): an outage until the new pods "
        "are ready",
    )
    max_unavailable: int | str | None = Field(
        None,
        description="pods (or a percentage of replicas, rounded up) down at once during a RollingUpdate "
        "(default 1); the StatefulSet honours more than 1 from Kubernetes 1.35 (MaxUnavailableStatefulSet, "
        "before that an alpha gate: without it one pod at a time); never surges",
        json_schema_extra={"minimum": 1, "pattern": _PERCENT},
    )

    node_loss_grace_seconds: int | None = Field(
        None, ge=0, le=86400,
        description="opt-in: seconds an engine pod may stay on a NotReady or unreachable node before the operator "
        "force-deletes it (grace period 0) so the StatefulSet recreates it on another node; unset: never (mark a "
        "node that is down for good with the node.kubernetes.io/out-of-service taint instead). A node that only "
        "stopped reporting may still run the pod: set it where such a node is known to be down",
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
    """The client Service in front of the engine pods."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type")
    port: int = Field(8000, ge=1, le=65535, description="Service port; the engine listens on it too")


class MonitoringSpec(_Model):
    """A Prometheus Operator monitor for the engine's /metrics (dlo_* for dlo, vllm:* for vllm-omni)."""

    enabled: bool = Field(True, description="create a PodMonitor/ServiceMonitor where its CRD is installed (on by "
                          "default; off where the chart's podMonitor or another scrape covers the engines: two monitors "
                          "of one pod scrape it twice)")
    kind: Literal["PodMonitor", "ServiceMonitor"] = Field(
        "PodMonitor", description="PodMonitor (each pod) or ServiceMonitor (through the client Service)"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="labels your Prometheus selects")
    interval: str = Field("15s", description="scrape interval")


# dp x sp = devicesPerNode: dp requests at once, each on sp devices (sequence parallelism).
_SP_RULE = ("self.devicesPerNode % self.sp == 0",
            "devicesPerNode must be a multiple of sp: dp = devicesPerNode / sp requests run at once, each on sp devices")
_SP_ENGINE_RULE = ("self.sp == 1 || !has(self.engine) || !has(self.engine.kind) || self.engine.kind == 'dlo'",
                   "sp > 1 needs engine.kind dlo (sequence parallelism with offload is dlo's)")
# the switches of allgather's weight gathers act only where blocks are gathered over several devices
_GATHER_MODE_RULE = (
    "!has(self.engine) || ((!has(self.engine.gather) || self.engine.gather == 'collective')"
    " && !has(self.engine.gatherMaxCtas)) || ((self.mode == 'auto' || self.mode == 'allgather')"
    " && self.devicesPerNode > 1)",
    "engine.gather peer and engine.gatherMaxCtas act on allgather's weight gathers: only with mode auto or "
    "allgather and devicesPerNode > 1",
)
_VIDEOS_RULE = (
    "!has(self.videos) || !has(self.videos.claimName) || !has(self.engine) || !has(self.engine.kind)"
    " || self.engine.kind == 'dlo'",
    "videos.claimName is where dlo serve keeps video jobs: only with engine.kind dlo",
)
_LORA_ENGINE_RULE = (
    "!has(self.lora) || !has(self.engine) || !has(self.engine.kind) || self.engine.kind == 'dlo'",
    "lora is dlo serve's --lora-dir: only with engine.kind dlo",
)
_LORA_NOT_MODEL_RULE = (
    "!has(self.lora) || !has(self.lora.uri) || !has(self.model.uri) || self.lora.uri != self.model.uri",
    "lora.uri is model.uri: the adapters are a folder of their own (NAME.safetensors files or NAME/ folders)",
)
_ULYSSES_RULE = (
    "!has(self.engine) || !has(self.engine.ulyssesExchange) || self.sp > 1",
    "engine.ulyssesExchange is how sequence-parallel ranks exchange: only with sp > 1",
)


class DLODeploymentSpec(_Model):
    """What to serve, on how many nodes, with which engine and offload mode."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_SP_RULE, _SP_ENGINE_RULE, _GATHER_MODE_RULE, _ULYSSES_RULE,
                                                         _VIDEOS_RULE, _LORA_ENGINE_RULE, _LORA_NOT_MODEL_RULE))

    model: ModelSource
    replicas: int = Field(1, ge=0, description="nodes: one engine pod per node")
    devices_per_node: int = Field(1, ge=1, description="devices (engine ranks) per node: dp x sp")
    sp: int = Field(1, ge=1, description="sequence-parallel devices per request (dlo serve --sp); "
                    "dp = devicesPerNode / sp requests run at once")
    accelerator_resource: str = Field(
        "nvidia.com/gpu", min_length=1, description="extended resource of the accelerators, e.g. huawei.com/Ascend910"
    )
    mode: ModeOrAuto = Field(
        "auto",
        description="offload mode: auto (decided from the node profiles), allgather, rank-local or resident",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    warmer: WarmerSpec = Field(default_factory=WarmerSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    videos: VideosSpec = Field(default_factory=VideosSpec)
    pod: EnginePodSpec = Field(default_factory=EnginePodSpec)
    lora: LoraSource | None = Field(None, description="LoRA adapters the engine loads (dlo serve --lora-dir /lora): "
                                    "a claim, a node folder or a uri fetched onto the nodes")

    @property
    def dp(self) -> int:
        """Requests a node runs at once: devicesPerNode / sp."""
        return self.devices_per_node // self.sp

    @model_validator(mode="after")
    def _sp_divides_devices(self) -> DLODeploymentSpec:
        broken = []
        if self.devices_per_node % self.sp:
            broken.append(_SP_RULE[1])
        if self.sp > 1 and self.engine.kind != "dlo":
            broken.append(_SP_ENGINE_RULE[1])
        gathers = self.engine.gather == "peer" or self.engine.gather_max_ctas is not None
        if gathers and not (self.mode in ("auto", "allgather") and self.devices_per_node > 1):
            broken.append(_GATHER_MODE_RULE[1])
        if self.engine.ulysses_exchange is not None and self.sp == 1:
            broken.append(_ULYSSES_RULE[1])
        if self.videos.claim_name is not None and self.engine.kind != "dlo":
            broken.append(_VIDEOS_RULE[1])
        if self.lora is not None and self.engine.kind != "dlo":
            broken.append(_LORA_ENGINE_RULE[1])
        if self.lora is not None and self.lora.uri is not None and self.lora.uri == self.model.uri:
            broken.append(_LORA_NOT_MODEL_RULE[1])
        if broken:
            raise ValueError("; ".join(broken))
        return self


def with_default_image(spec: DLODeploymentSpec, image: str) -> DLODeploymentSpec:
    """`spec` with `image` as its engine image when it names none."""
    if spec.engine.image:
        return spec
    return spec.model_copy(update={"engine": spec.engine.model_copy(update={"image": image})})


def parse_spec(spec: dict[str, Any]) -> DLODeploymentSpec:
    """Validate a spec as the API server would (schema and CEL rules); raise SpecError naming fields."""
    try:
        # strict: no coercion the API server would not do ("3" is not an integer, "yes" no boolean)
        return DLODeploymentSpec.model_validate(spec, strict=True)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "kubernetes_schema":  # a Kubernetes type's own fields: name each one
                for below, what in err["ctx"]["problems"]:
                    problems.append(f"spec.{'.'.join(p for p in (where, below) if p)}: {what}")
                continue
            problems.append(f"spec.{where or 'spec'}: {err['msg']}")
        raise SpecError("; ".join(problems)) from None
