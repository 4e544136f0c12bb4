"""operator/modes.py: `spec.mode: auto` resolved with the agent's policy over node profiles."""

import json
from pathlib import Path

from dlo.operator import modes
from dlo.operator.models import parse_spec

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "examples" / "profiles"


def node(name: str, profile: dict | None, gpus: int = 8, labels: dict | None = None, unschedulable=False) -> dict:
    annotations = {modes.PROFILE_ANNOTATION: json.dumps(profile)} if profile is not None else {}
    return {
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations},
        "spec": {"unschedulable": unschedulable},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}},
    }


def profile(name: str) -> dict:
    return json.loads((PROFILES / name).read_text())


SPEC = {"model": {"path": "/models/wan2.1-14b"}, "devicesPerNode": 8}


def test_explicit_mode_is_taken_as_is():
    spec = parse_spec({**SPEC, "mode": "rank-local"})
    res = modes.resolve_mode(spec, [node("a", profile("l4-node.json"))])
    assert (res.mode, res.reason) == ("rank-local", "spec.mode is rank-local")


def test_auto_uses_the_policy_decision_of_one_node():
    res = modes.resolve_mode(parse_spec(SPEC), [node("big", profile("h200-node.json"))])
    assert res.mode == "resident" and res.reason.startswith("node big: ") and "fits one device" in res.reason


def test_auto_spells_rank_local_as_the_engine_does():
    p = profile("l4-node.json")
    p["host_memory_bytes"] = 4_000_000_000_000  # room for a host copy per rank
    res = modes.resolve_mode(parse_spec(SPEC), [node("roomy", p)])
    assert res.mode == "rank-local"


def test_most_constrained_node_wins():
    nodes = [node("big", profile("h200-node.json")), node("small", profile("l4-node.json"))]
    res = modes.resolve_mode(parse_spec(SPEC), nodes)
    assert res.mode == "allgather"
    assert res.reason.startswith("node small: ") and "most constrained of 2 nodes" in res.reason


def test_nodes_outside_placement_or_without_accelerators_are_ignored():
    spec = parse_spec({**SPEC, "placement": {"nodeSelector": {"pool": "big"}}})
    nodes = [
        node("big", profile("h200-node.json"), labels={"pool": "big"}),
        node("small", profile("l4-node.json")),  # no matching label
        node("few", profile("l4-node.json"), gpus=4, labels={"pool": "big"}),  # dp 8 does not fit
        node("cordoned", profile("l4-node.json"), labels={"pool": "big"}, unschedulable=True),
    ]
    assert [n["metadata"]["name"] for n in modes.eligible_nodes(nodes, spec)] == ["big"]
    assert modes.resolve_mode(spec, nodes).mode == "resident"


def test_without_profiles_auto_falls_back_to_allgather_and_says_why():
    res = modes.resolve_mode(parse_spec(SPEC), [node("bare", None)])
    assert res.mode == "allgather" and "bare: no profile" in res.reason
    res = modes.resolve_mode(parse_spec({**SPEC, "model": {"path": "/models/unknown"}}), [node("a", profile("l4-node.json"))])
    assert res.mode == "allgather" and "no facts for model 'unknown'" in res.reason


def test_spec_facts_override_the_profiles():
    spec = parse_spec({**SPEC, "model": {"path": "/models/other", "facts": {"bytes": 2_000_000_000, "largestBlockBytes": 50_000_000}}})
    assert modes.resolve_mode(spec, [node("a", profile("l4-node.json"))]).mode == "resident"


def test_policy_error_on_a_node_is_reported_not_raised():
    p = profile("l4-node.json")
    p["host_memory_bytes"] = 1_000_000_000  # nothing fits
    res = modes.resolve_mode(parse_spec(SPEC), [node("tiny", p)])
    assert res.mode == "allgather" and "tiny: no mode fits" in res.reason


def test_inputs_digest_changes_with_eligible_profiles_only():
    spec = parse_spec(SPEC)
    a = modes.resolve_mode(spec, [node("a", profile("l4-node.json"))]).inputs
    same = modes.resolve_mode(spec, [node("a", profile("l4-node.json")), node("x", None, gpus=0)]).inputs
    p = profile("l4-node.json")
    p["host_memory_bytes"] *= 2
    changed = modes.resolve_mode(spec, [node("a", p)]).inputs
    assert a == same and a != changed


def test_previous_auto_decision_is_kept_while_its_inputs_stand():
    spec = parse_spec(SPEC)
    nodes = [node("a", profile("l4-node.json"))]
    first = modes.resolve_mode(spec, nodes)
    kept = modes.Resolution("rank-local", "decided earlier", first.inputs)
    assert modes.resolve_mode(spec, nodes, kept) is kept
    stale = modes.Resolution("rank-local", "decided earlier", "other-inputs")
    assert modes.resolve_mode(spec, nodes, stale) == first
    explicit = parse_spec({**SPEC, "mode": "resident"})
    assert modes.resolve_mode(explicit, nodes, kept).mode == "resident"


def test_model_residency_per_node_from_profiles():
    nodes = [node("a", profile("l4-node.json")), node("b", profile("h200-node.json")), node("c", None)]
    assert modes.model_residency(nodes, parse_spec(SPEC)) == {"a": 0.5, "b": 0.998}
    other = parse_spec({**SPEC, "model": {"path": "/models/other"}})
    assert modes.model_residency(nodes, other) == {"a": None, "b": None}


def test_auto_with_sp_asks_the_policy_for_dp_x_sp_and_the_digest_knows_sp():
    """spec.sp (issue 14): the policy sees dp = devicesPerNode / sp and sp; a changed sp is a new input."""
    from unittest import mock

    from dlo.plan import policy

    spec = parse_spec({**SPEC, "sp": 2})
    nodes = [node("a", profile("l4-node.json"))]
    with mock.patch.object(policy, "choose_mode", wraps=policy.choose_mode) as spy:
        res = modes.resolve_mode(spec, nodes)
    assert spy.call_args.args[2] == 4 and spy.call_args.kwargs["sp"] == 2
    assert res.inputs != modes.resolve_mode(parse_spec(SPEC), nodes).inputs
