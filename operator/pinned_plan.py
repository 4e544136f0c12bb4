"""The deployment plan a DLODeployment's pods run, pinned in `status.plan`.

Owns: `PinnedPlan` (the mode, the pod's memory request, why, the per node type decisions, the
inputs' digest, and what it was made for: the spec's generation, the model the pods run and the
replan annotation's value), `REPLAN_ANNOTATION`, and `pin`: the recorded plan stands until the
spec's generation, the pods' model or the replan annotation changes; an inventory or profile change
that would give another plan only sets the `PlanOutdated` condition, with the difference and the
command that applies it. The pod template is built from the spec and the pinned plan alone, so a
new node (of a known type or not) never rolls a pod.
Must never: talk to the API server (the reconcile reads and writes; this module is pure) or
import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dlo.operator import modes
from dlo.operator.models import DLODeploymentSpec
from dlo.plan.facts import Mode

REPLAN_ANNOTATION = "dlo.dev/replan"  # any new value makes the operator plan again from the inventory
Verdict = tuple[str, str, str]


@dataclass(frozen=True)
class PinnedPlan:
    mode: Mode
    reason: str
    memory_bytes: int | None  # the engine container's memory request (None: no estimate)
    inputs: str  # digest of the spec's planned fields and the eligible node types
    generation: int | None  # metadata.generation planned for
    model: str  # the model the pods run (JSON of its spec), planned for
    replan: str = ""  # the replan annotation's value answered
    node_types: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def to_status(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason, "memoryBytes": self.memory_bytes, "inputs": self.inputs,
                "generation": self.generation, "model": self.model, "replan": self.replan,
                "nodeTypes": [dict(t) for t in self.node_types]}

    @classmethod
    def from_status(cls, doc: dict[str, Any] | None) -> "PinnedPlan | None":
        if not doc or not doc.get("mode"):
            return None
        return cls(mode=doc["mode"], reason=doc.get("reason", ""), memory_bytes=doc.get("memoryBytes"),
                   inputs=doc.get("inputs", ""), generation=doc.get("generation"), model=doc.get("model", ""),
                   replan=doc.get("replan", ""), node_types=tuple(doc.get("nodeTypes") or ()))

    def differs(self, other: "PinnedPlan") -> str:
        """What `other` would change, in words ('' when the pods would run the same)."""
        out = []
        if other.mode != self.mode:
            out.append(f"mode {self.mode} -> {other.mode} ({other.reason})")
        if other.memory_bytes != self.memory_bytes:
            out.append(f"memory request {_gib(self.memory_bytes)} -> {_gib(other.memory_bytes)}")
        return "; ".join(out)


def _gib(n: int | None) -> str:
    return "none" if n is None else f"{n / 2**30:.1f} GiB"


def make(spec: DLODeploymentSpec, pods_spec: DLODeploymentSpec, nodes: list[dict[str, Any]], generation: int | None,
         replan: str) -> PinnedPlan:
    """A plan from the inventory as it is now (`modes.resolve_mode` per node type; the memory request
    for the model the pods run)."""
    resolution = modes.resolve_mode(spec, nodes)
    return PinnedPlan(mode=resolution.mode, reason=resolution.reason,
                      memory_bytes=modes.pod_memory_bytes(pods_spec, nodes, resolution.mode),
                      inputs=resolution.inputs, generation=generation, model=model_of(pods_spec), replan=replan,
                      node_types=resolution.node_types)


def model_of(spec: DLODeploymentSpec) -> str:
    return spec.model.model_dump_json(by_alias=True, exclude_none=True)


def pin(body: dict[str, Any], spec: DLODeploymentSpec, pods_spec: DLODeploymentSpec,
        nodes: list[dict[str, Any]]) -> tuple[PinnedPlan, PinnedPlan | None, Verdict]:
    """(the plan the pods run, the recorded one it replaces or None, the PlanOutdated verdict)."""
    meta = body["metadata"]
    generation = meta.get("generation")
    replan = (meta.get("annotations") or {}).get(REPLAN_ANNOTATION, "")
    recorded = PinnedPlan.from_status((body.get("status") or {}).get("plan"))
    if (recorded is None or recorded.generation != generation or recorded.replan != replan
            or recorded.model != model_of(pods_spec)):
        return make(spec, pods_spec, nodes, generation, replan), recorded, ("False", "PlanCurrent", "")
    digest = modes.inputs_digest(spec, modes.node_types(spec, modes.eligible_nodes(nodes, spec)))
    if digest == recorded.inputs:
        return recorded, None, ("False", "PlanCurrent", "")
    now = make(spec, pods_spec, nodes, generation, replan)
    change = recorded.differs(now)
    if not change:  # another inventory, the same plan: remember what it was made from
        return dataclasses.replace(recorded, inputs=now.inputs, node_types=now.node_types), None, \
            ("False", "PlanCurrent", "")
    apply = (f"kubectl annotate dlod {meta['name']} -n {meta.get('namespace', '')} "
             f"{REPLAN_ANNOTATION}=$(date +%s) --overwrite")
    return recorded, None, ("True", "InventoryChanged",
                            f"the eligible nodes now give another plan: {change}; no pod is replaced until you "
                            f"apply it ({apply}) or edit the spec")
