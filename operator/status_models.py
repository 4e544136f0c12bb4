"""`status` of a DLODeployment: what the operator observed (written by the operator only).

Owns: `DLODeploymentStatus`, `NodeStatus`, `NodeModelStatus`, `Condition` (metav1.Condition).
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from dlo.plan.facts import Mode
from dlo.operator.spec_base import SpecModel as _Model


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(description="Ready, Progressing, CacheWarmed, ModelReady, Degraded or PlanOutdated")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown")
    observed_generation: int | None = Field(None, description="metadata.generation the condition was set for")
    last_transition_time: str = Field(description="when the status last changed (RFC 3339)")
    reason: str = Field(
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="why, in one CamelCase word"
    )
    message: str = Field("", description="why, for humans")


class NodeModelStatus(_Model):
    """model.uri (or lora.uri): the fetch of the model (or the adapters) on one node."""

    state: Literal["complete", "fetching", "pending", "failed"] = Field(
        description="complete: the node holds the whole folder; fetching: a fetch Job runs; pending: waiting for a "
        "fetch slot (or for the node's other fetch); failed: the last fetch failed (reason and message), tried "
        "again later"
    )
    bytes: int | None = Field(None, ge=0, description="bytes on the node so far")
    total_bytes: int | None = Field(None, ge=0, description="bytes of the whole model")
    percent: float | None = Field(None, ge=0, le=100, description="bytes / totalBytes, in percent")
    reason: str | None = Field(None, description="why a fetch failed (dlo fetch's reason: disk_full, auth, refused, ...)")
    message: str | None = Field(None, description="what the fetch said")


class NodeStatus(_Model):
    """A node that runs an engine pod, or fetches the model (or the adapters) for one."""

    name: str = Field(description="node name")
    phase: str | None = Field(None, description="phase of the engine pod on that node (absent: none there yet)")
    cached_ratio: float | None = Field(
        None, ge=0, le=1, description="page-cache residency of the model on that node, from its profile"
    )
    model: NodeModelStatus | None = Field(None, description="model.uri: the fetch of the model on that node")
    lora: NodeModelStatus | None = Field(None, description="lora.uri: the fetch of the adapters on that node")


class NodeTypePlan(_Model):
    """The plan's decision on one type of eligible node (nodes alike in what the plan reads)."""

    nodes: list[str] = Field(default_factory=list, description="the eligible nodes of this type")
    mode: Mode = Field(description="the mode the plan chose on this node type")
    reason: str = Field("", description="why, with the policy's estimates")


class PlanStatus(_Model):
    """The deployment plan the pods run, pinned: made again only when the spec's generation, the
    pods' model or the `dlo.dev/replan` annotation changes (PlanOutdated says when the inventory
    would give another)."""

    mode: Mode = Field(description="the offload mode the pods run")
    reason: str = Field("", description="why that mode (auto: the most constrained node type's decision)")
    memory_bytes: int | None = Field(None, ge=0, description="the engine container's memory request")
    inputs: str = Field("", description="digest of the spec's planned fields and the eligible node types")
    generation: int | None = Field(None, description="metadata.generation the plan was made for")
    model: str = Field("", description="the model the pods run when the plan was made (its spec, JSON)")
    replan: str = Field("", description="the dlo.dev/replan annotation's value the plan answered")
    node_types: list[NodeTypePlan] = Field(default_factory=list, description="auto: each node type's decision")


class DLODeploymentStatus(_Model):
    """What the operator observed; written by the operator only."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = Field(None, description="metadata.generation this status is for")
    replicas: int = Field(0, description="engine pods (not terminating)")
    ready_replicas: int = Field(0, description="engine pods that are Ready")
    updated_replicas: int = Field(0, description="engine pods on the current pod template")
    selector: str = Field("", description="label selector of the engine pods (scale subresource)")
    url: str = Field("", description="URL of the client Service inside the cluster")
    mode: Mode | None = Field(None, description="the offload mode the pods run")
    mode_reason: str = Field("", description="why that mode (for auto: the deciding node and its estimates)")
    mode_inputs: str = Field("", description="digest of what the mode was decided from")
    plan: PlanStatus | None = Field(None, description="the deployment plan the pods run, pinned")
    cached_ratio: float | None = Field(None, ge=0, le=1, description="lowest page-cache residency over nodes")
    nodes: list[NodeStatus] = Field(
        default_factory=list, description="the nodes the engine pods run on, and those fetching the model for them"
    )
    autoscaler: str = Field("", description="the autoscaling object made for spec.autoscaling: ScaledObject, "
                            "HorizontalPodAutoscaler, or empty")
    warnings: list[str] = Field(
        default_factory=list, description="what works but may hurt (e.g. video jobs the drain cannot finish)"
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, CacheWarmed, ModelReady, Degraded and PlanOutdated (metav1.Condition, one per "
                    "type)",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
