"""`status` of a DLODeployment: what the operator observed (written by the operator only).

Owns: `DLODeploymentStatus`, `NodeStatus`, `Condition` (metav1.Condition).
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from dlo.engine.facts import Mode
from dlo.operator.spec_base import SpecModel as _Model


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(description="Ready, Progressing, CacheWarmed or Degraded")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown")
    observed_generation: int | None = Field(None, description="metadata.generation the condition was set for")
    last_transition_time: str = Field(description="when the status last changed (RFC 3339)")
    reason: str = Field(
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="why, in one CamelCase word"
    )
    message: str = Field("", description="why, for humans")


class NodeStatus(_Model):
    """One engine pod's node."""

    name: str = Field(description="node name")
    phase: str = Field("Unknown", description="phase of the engine pod on that node")
    cached_ratio: float | None = Field(
        None, ge=0, le=1, description="page-cache residency of the model on that node, from its profile"
    )


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
    cached_ratio: float | None = Field(None, ge=0, le=1, description="lowest page-cache residency over nodes")
    nodes: list[NodeStatus] = Field(default_factory=list, description="the nodes the engine pods run on")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, CacheWarmed and Degraded (metav1.Condition, one per type)",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
