"""Resolution of `spec.mode: auto` from the node profiles the agent publishes.

Owns: which nodes a DLODeployment's pods may land on (`Selector`, `eligible_nodes`), the model
facts per node (spec override, else the node profile's entry for the model folder), the node types
(`node_types`: eligible nodes alike in what a plan reads), and `resolve_mode`, which asks
`dlo.plan.deployment.plan` once per node type (`node_plan`) and keeps the decision of the most
constrained one (where the fewest modes fit). Parsed profiles, node types, plans and estimates are
cached by what they are made from (a profile's text; a type's key and the spec's planned fields). Without any usable profile, `auto` falls back to allgather (the mode with the
least host and device memory per node) and says why.
Must never: talk to the API server or import torch; it is pure over the node objects it is given.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlo.plan.profile import ANNOTATION as PROFILE_ANNOTATION  # the agent writes it; one key
from dlo.plan.facts import MODES, Mode, ModelFacts, key_of_mode
from dlo.operator.models import DLODeploymentSpec
from dlo.plan.budget import DeviceBudgetError
from dlo.plan.policy import PolicyError

if TYPE_CHECKING:
    from dlo.plan.deployment import DeploymentPlan


@dataclass(frozen=True)
class Resolution:
    mode: Mode
    reason: str
    # Digest of the inputs (spec fields and eligible node types): re-resolve only when it changes.
    inputs: str
    node_types: tuple[dict[str, Any], ...] = ()  # auto: each node type's nodes, mode and reason


@dataclass(frozen=True)
class Selector:
    """What makes a node eligible for a DLODeployment's pods (read from its spec)."""

    node_selector: tuple[tuple[str, str], ...] = ()
    resource: str = "nvidia.com/gpu"
    devices: int = 1
    cpu: bool = False  # engine.device cpu: no accelerator asked

    @classmethod
    def of(cls, spec: DLODeploymentSpec) -> "Selector":
        return cls(tuple(sorted(spec.placement.node_selector.items())), spec.accelerator_resource,
                   spec.devices_per_node, spec.engine.device == "cpu")

    def matches(self, node: dict[str, Any]) -> bool:
        labels = node.get("metadata", {}).get("labels", {}) or {}
        if any(labels.get(k) != v for k, v in self.node_selector):
            return False
        if node.get("spec", {}).get("unschedulable"):
            return False
        if self.cpu:
            return True
        allocatable = node.get("status", {}).get("allocatable", {}) or {}
        try:
            return int(str(allocatable.get(self.resource, "0"))) >= self.devices
        except ValueError:
            return False


def _matches(node: dict[str, Any], spec: DLODeploymentSpec) -> bool:
    return Selector.of(spec).matches(node)


def eligible_nodes(nodes: list[dict[str, Any]], spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    """Nodes the engine pods may land on: node selector, schedulable, enough accelerators."""
    selector = Selector.of(spec)
    return sorted((n for n in nodes if selector.matches(n)), key=lambda n: n["metadata"]["name"])


@functools.lru_cache(maxsize=8192)
def parsed_profile(raw: str) -> Any:
    """A node's profile annotation parsed (`NodeProfile`), or the ValueError it raises: parsed once
    per distinct annotation, not once per node and round."""
    from dlo.plan.profile import NodeProfile

    try:
        return NodeProfile.from_annotation(raw)
    except ValueError as e:
        return e


@functools.lru_cache(maxsize=8192)
def _node_type(raw: str | None, override: ModelFacts | None, folder: str) -> tuple[str, Any, ModelFacts | None]:
    """(the type's key, the profile, the model facts) of a node with this annotation, cached."""
    if raw is None:
        return "no profile", None, None
    profile = parsed_profile(raw)
    if isinstance(profile, ValueError):
        return f"unreadable profile ({str(profile).splitlines()[0]})", None, None
    facts = override if override is not None else _profile_facts(profile, folder)
    if facts is None:
        return f"no facts for model {folder!r}", profile, None
    return _type_key(profile, facts), profile, facts


def _profile_facts(profile: Any, folder: str) -> ModelFacts | None:
    entry = profile.models.get(folder)
    return None if entry is None else entry.facts()


def node_profile_json(node: dict[str, Any]) -> str | None:
    return (node.get("metadata", {}).get("annotations", {}) or {}).get(PROFILE_ANNOTATION)


@dataclass(frozen=True)
class NodeType:
    """Eligible nodes alike in everything the plan reads (their profile less the node's name and the
    page-cache residency, with the spec's model facts): one plan answers for all of them."""

    key: str  # canonical JSON of what the plan reads, or why the nodes have no usable profile
    profile: Any  # NodeProfile, or None where `key` says why there is none
    facts: ModelFacts | None
    nodes: tuple[str, ...]


def node_types(spec: DLODeploymentSpec, eligible: list[dict[str, Any]]) -> list[NodeType]:
    """The eligible nodes grouped by what their plan depends on, in node-name order (each distinct
    profile parsed and keyed once: `_node_type` is cached)."""
    override = spec.model.facts.facts() if spec.model.facts is not None else None
    folder = spec.model.folder_name
    groups: dict[str, tuple[Any, ModelFacts | None, list[str]]] = {}
    for node in eligible:
        key, profile, facts = _node_type(node_profile_json(node), override, folder)
        groups.setdefault(key, (profile if facts is not None else None, facts, []))[2].append(node["metadata"]["name"])
    return [NodeType(k, p, f, tuple(names)) for k, (p, f, names) in groups.items()]


def _type_key(profile: Any, facts: ModelFacts) -> str:
    plain = profile.model_copy(update={"node": "", "models": {}, "model_errors": None})
    return json.dumps({"profile": plain.model_dump(mode="json"), "model": facts.__dict__}, sort_keys=True,
                      default=str)


def inputs_digest(spec: DLODeploymentSpec, types: list[NodeType]) -> str:
    """What a plan is made from: the spec's planned fields and the eligible node types (not their
    number, names or page-cache residency: another node of a known type changes nothing)."""
    payload = {
        "dp": spec.devices_per_node,
        **({"sp": spec.sp} if spec.sp != 1 else {}),
        **({"budget": spec.engine.device_budget_bytes()} if spec.engine.max_device_memory else {}),
        "model": spec.model.model_dump(mode="json"),
        "types": sorted(t.key for t in types),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def resolve_mode(spec: DLODeploymentSpec, nodes: list[dict[str, Any]], previous: Resolution | None = None) -> Resolution:
    """The mode for `spec`: an explicit mode as is; `auto` asks the plan per eligible node type.

    `previous` (an earlier `auto` decision) is kept while its inputs are unchanged, so a decision
    is made once and again only when the eligible node types change.
    """
    types = node_types(spec, eligible_nodes(nodes, spec))
    digest = inputs_digest(spec, types)
    if spec.mode != "auto":
        return Resolution(spec.mode, f"spec.mode is {spec.mode}", digest)
    if previous is not None and previous.inputs == digest:
        return previous
    return _resolve_with_plans(spec, types, digest)


def model_residency(nodes: list[dict[str, Any]], spec: DLODeploymentSpec) -> dict[str, float | None]:
    """node name -> page-cache residency of the spec's model, as each node's profile reports it."""
    out: dict[str, float | None] = {}
    for node in nodes:
        raw = node_profile_json(node)
        profile = parsed_profile(raw) if raw is not None else None
        if profile is None or isinstance(profile, ValueError):
            continue  # an unreadable profile reports nothing; resolve_mode names it in its reason
        entry = profile.models.get(spec.model.folder_name)
        out[node["metadata"]["name"]] = entry.resident_ratio if entry else None
    return out


def _resolve_with_plans(spec: DLODeploymentSpec, types: list[NodeType], digest: str) -> Resolution:
    # (modes that fit on the node type, its first node, decision, type): the type where the fewest
    # modes fit is the most constrained; its decision is the one every node can run.
    decisions: list[tuple[int, str, Any, NodeType]] = []
    skipped: list[str] = []
    for nt in types:
        first = nt.nodes[0] + (f" (and {len(nt.nodes) - 1} more alike)" if len(nt.nodes) > 1 else "")
        if nt.profile is None or nt.facts is None:
            skipped.append(f"{first}: {nt.key}")
            continue
        try:
            decision = _cached(("plan", nt.key, spec.dp, spec.sp, spec.engine.device, spec.engine.device_budget_bytes()),
                               lambda nt=nt: node_plan(spec, nt.profile, nt.facts))
        except (PolicyError, DeviceBudgetError) as e:
            skipped.append(f"{first}: {str(e).removeprefix('--mode auto: ')}")
            continue
        if decision.decision is None:  # the policy gave no answer: the plan's fixed rule is no node's
            skipped.append(f"{first}: {decision.policy_error}")
            continue
        fitting = sum(1 for est in decision.estimates.values() if est.fits)
        decisions.append((fitting, nt.nodes[0], decision.decision, nt))
    per_type = tuple({"nodes": list(nt.nodes), "mode": d.engine_mode, "reason": d.reason}
                     for _, _, d, nt in decisions)
    if not decisions:
        why = "; ".join(skipped) if skipped else "no eligible node"
        return Resolution("allgather", f"auto resolved to allgather (the frugal default): {why}", digest)
    _, name, decision, _ = min(decisions, key=lambda d: (d[0], d[1]))
    mode = decision.engine_mode
    if mode not in MODES:
        raise ValueError(f"the policy chose an unknown mode {decision.mode!r}")
    nodes = sum(len(nt.nodes) for *_, nt in decisions)
    suffix = f" (most constrained of {nodes} nodes)" if nodes > 1 else ""
    return Resolution(mode, f"node {name}: {decision.reason}{suffix}", digest, per_type)


_CACHE: dict[tuple[Any, ...], tuple[bool, Any]] = {}
CACHE_SIZE = 4096


def _cached(key: tuple[Any, ...], compute: Any) -> Any:
    """`compute()` once per key (a node type's key and the spec's planned fields: the plan's
    inputs), its answer or its PolicyError kept; a plan is pure over them."""
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) >= CACHE_SIZE:
            _CACHE.clear()
        try:
            hit = (True, compute())
        except (PolicyError, DeviceBudgetError) as e:
            hit = (False, e)
        _CACHE[key] = hit
    if not hit[0]:
        raise hit[1]
    return hit[1]


def node_plan(spec: DLODeploymentSpec, profile: Any, facts: ModelFacts) -> DeploymentPlan:
    """The deployment plan for `spec` on one node (`dlo.plan.deployment.plan`, the one `dlo serve` and
    `dlo plan` make; the operator knows the transformer's facts, not the pipeline's memory)."""
    from dlo.plan.deployment import PlanAsk, device_of, plan

    device = device_of(profile) if spec.engine.device == "auto" else spec.engine.device
    ask = PlanAsk(dp=spec.dp, sp=spec.sp, mode="auto", device=device,
                  max_device_memory=spec.engine.device_budget_bytes() or 0)
    return plan(ask, profile=profile, transformer=facts)


def model_facts(spec: DLODeploymentSpec, profile: Any) -> ModelFacts | None:
    """The model facts for the policy: the spec's override, else the profile's entry for the folder."""
    if spec.model.facts is not None:
        return spec.model.facts.facts()
    entry = profile.models.get(spec.model.folder_name)
    return None if entry is None else entry.facts()


def pod_memory_bytes(spec: DLODeploymentSpec, nodes: list[dict[str, Any]], mode: Mode) -> int | None:
    """What the engine pod's cgroup is charged at its cold-start peak in `mode` (the policy's
    `cold_start_peak_bytes`; CPU ranks add their "device" weights, which live in host memory), the
    largest over the eligible node types with a usable profile and model facts; None without any."""
    from dlo.plan.policy import estimate_modes
    from dlo.plan.profile import NodeProfile

    key = key_of_mode(mode)
    pairs = [(nt.key, nt.profile, nt.facts) for nt in node_types(spec, eligible_nodes(nodes, spec))
             if nt.profile is not None and nt.facts is not None]
    if not pairs and spec.model.facts is not None:  # no node reports: the spec's facts on a bare node
        pairs = [("bare node", NodeProfile(), spec.model.facts.facts())]
    out: list[int] = []
    budget = spec.engine.device_budget_bytes()
    for type_key, profile, facts in pairs:
        try:
            est = _cached(("estimates", type_key, facts, spec.dp, spec.sp, budget),
                          lambda p=profile, f=facts: estimate_modes(p, f, spec.dp, sp=spec.sp, require_bandwidth=False,
                                                                    device_budget_bytes=budget))[key]
        except PolicyError:
            continue
        host_devices = spec.devices_per_node * est.device_weight_bytes if spec.engine.device == "cpu" else 0
        out.append(est.cold_start_peak_bytes + host_devices)
    return max(out) if out else None
