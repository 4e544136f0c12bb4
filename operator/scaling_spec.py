"""`spec.autoscaling` and `spec.videos` of a DLODeployment: how many nodes serve, and where finished
videos live so that scaling in loses none.

Owns: `AutoscalingSpec` (KEDA ScaledObject when KEDA is installed, else an autoscaling/v2 HPA on an
external metric; both scale the DLODeployment's scale subresource) and `VideosSpec`, with their
rules (Python and CEL).
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from dlo.operator.k8s_schemas import cel_rules
from dlo.operator.spec_base import SpecModel as _Model

_RANGE_RULE = ("self.minReplicas <= self.maxReplicas", "autoscaling.minReplicas must be at most maxReplicas")
# With no engine running nothing reports the load (the query is `vector(0)`): a deployment scaled to
# zero would never scale up again. Scaling from zero needs an activator that holds the first request.
_ZERO_RULE = (
    "self.minReplicas >= 1",
    "autoscaling.minReplicas 0 is refused: with no engine running nothing reports the load and the deployment "
    "would never scale up again; use minReplicas 1 (one node always serves), or turn autoscaling off and scale to "
    "zero by hand (spec.replicas 0, kubectl scale dlod NAME --replicas 0); scaling from zero needs an activator "
    "that holds the first request (e.g. KEDA's HTTP add-on), which the operator does not set up",
)


class AutoscalingSpec(_Model):
    """Replicas follow the load: the requests waiting or running per engine rank, from the engines'
    `dlo_queue_depth` and `dlo_requests_running` (docs/operator.md, "Autoscaling")."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_RANGE_RULE, _ZERO_RULE))

    enabled: bool = Field(False, description="create a KEDA ScaledObject (or an HPA) for this resource")
    min_replicas: int = Field(1, ge=0, description="fewest nodes, at least 1 (CEL: 0 is refused, nothing would "
                              "scale the deployment up again)")
    max_replicas: int = Field(4, ge=1, description="most nodes")
    target_queue_depth_per_rank: float = Field(
        2.0, ge=0.01, le=1000,
        description="requests waiting or running per engine rank the autoscaler aims at (a pod runs "
        "devicesPerNode ranks, dp requests at once)",
    )
    scale_down_stabilization_seconds: int = Field(
        300, ge=0, le=3600, description="how long the load must stay low before a node is removed"
    )
    engine: Literal["auto", "keda", "hpa"] = Field(
        "auto", description="auto: a KEDA ScaledObject when KEDA's CRD is installed, else an HPA"
    )

    @model_validator(mode="after")
    def _rules(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(_RANGE_RULE[1])
        if self.min_replicas == 0:
            raise ValueError(_ZERO_RULE[1])
        return self


class VideosSpec(_Model):
    """Where finished video jobs are kept (`dlo serve --video-dir`)."""

    claim_name: str | None = Field(
        None, min_length=1,
        description="a ReadWriteMany PersistentVolumeClaim mounted at the engines' video folder instead of "
        "an emptyDir: a finished video survives its pod, and any pod answers a poll for it",
    )
    seconds_per_step: float | None = Field(
        None, ge=0.001,
        description="measured seconds of one denoising step of the largest video the limits allow "
        "(dlo_step_duration_seconds): the status warns when the limits allow video jobs longer than "
        "engine.shutdownGraceSeconds",
    )
