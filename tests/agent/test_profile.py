"""dlo.plan.profile: the contract JSON, annotation round trip, calibration and nominal figures."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dlo.plan.profile import (
    DEFAULT_H2D_BPS,
    CalibrationFragment,
    NodeProfile,
    apply_calibration,
    compute_rate,
    nominal_bf16_flops,
    nominal_collective_bps,
    nominal_h2d_bps,
)

CONTRACT_EXAMPLE = """
{"version": "v1", "node": "gpu-node-3",
 "accelerator": {"vendor": "nvidia", "model": "NVIDIA H200", "count": 8, "memory_bytes": 150754820096},
 "interconnect": {"kind": "nvlink", "collective_bandwidth_bps": 360000000000},
 "h2d_bandwidth_bps": 55300000000, "host_memory_bytes": 2000000000000, "numa_nodes": 2,
 "can_register_page_cache": true,
 "models": {"wan2.1-14b": {"bytes": 28600000000, "largest_block_bytes": 703000000, "blocks": 40,
                           "resident_ratio": 0.998}}}
"""


def test_contract_example_parses_and_round_trips_through_the_annotation() -> None:
    p = NodeProfile.model_validate_json(CONTRACT_EXAMPLE)
    assert p.accelerator.count == 8 and p.interconnect.kind == "nvlink"
    assert p.models["wan2.1-14b"].largest_block_bytes == 703_000_000
    assert p.measured is False
    assert NodeProfile.from_annotation(p.to_annotation()) == p
    # every contract key survives serialisation with its value (we add optional fields only)
    assert _contains(json.loads(p.to_annotation()), json.loads(CONTRACT_EXAMPLE))


def _contains(doc: object, expected: object) -> bool:
    if isinstance(expected, dict):
        return isinstance(doc, dict) and all(k in doc and _contains(doc[k], v) for k, v in expected.items())
    return doc == expected


def test_unknown_fields_from_a_newer_agent_are_ignored() -> None:
    doc = json.loads(CONTRACT_EXAMPLE) | {"future_field": 1}
    assert NodeProfile.model_validate(doc).node == "gpu-node-3"


@pytest.mark.parametrize(
    "patch",
    [{"version": "v2"}, {"accelerator": {"vendor": "amd"}}, {"host_memory_bytes": -1},
     {"models": {"m": {"bytes": 1, "largest_block_bytes": 1, "blocks": 1, "resident_ratio": 1.5}}}],
)
def test_invalid_profiles_are_rejected(patch: dict) -> None:
    with pytest.raises(ValidationError):
        NodeProfile.model_validate(json.loads(CONTRACT_EXAMPLE) | patch)


def test_calibration_replaces_bandwidths_and_marks_measured() -> None:
    p = NodeProfile.model_validate_json(CONTRACT_EXAMPLE)
    q = apply_calibration(p, CalibrationFragment(h2d_bandwidth_bps=50_000_000_000))
    assert q.h2d_bandwidth_bps == 50_000_000_000 and q.measured
    assert q.interconnect.collective_bandwidth_bps == 360_000_000_000
    r = apply_calibration(p, CalibrationFragment.model_validate_json('{"collective_bandwidth_bps": 1000}'))
    assert r.interconnect.collective_bandwidth_bps == 1000 and r.h2d_bandwidth_bps == p.h2d_bandwidth_bps
    assert apply_calibration(p, CalibrationFragment()) is p


def test_nominal_figures_by_device_model() -> None:
    assert nominal_h2d_bps("NVIDIA H200") == 55_300_000_000
    assert nominal_h2d_bps("Mystery Accelerator") == DEFAULT_H2D_BPS
    assert nominal_collective_bps("NVIDIA H200", "nvlink") == 360_000_000_000
    assert nominal_collective_bps("NVIDIA H200", "pcie", pcie_generation=5) == 40_000_000_000
    assert nominal_collective_bps("NVIDIA H200", "none") == 0
    assert nominal_collective_bps("Ascend910B3", "hccs") == 56_000_000_000
    assert nominal_bf16_flops("NVIDIA H200") == 738e12


def test_compute_rate_prefers_the_profile_figure() -> None:
    p = NodeProfile.model_validate_json(CONTRACT_EXAMPLE)
    assert compute_rate(p.accelerator) == 738e12
    faster = p.accelerator.model_copy(update={"bf16_flops": 1e15})
    assert compute_rate(faster) == 1e15


def test_model_profile_is_the_wire_form_of_model_facts() -> None:
    from dlo.plan.profile import ModelProfile
    from dlo.plan.facts import ModelFacts

    facts = ModelFacts(bytes=28_600_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=5_000_000)
    entry = ModelProfile.of(facts, resident_ratio=0.5)
    # flat on the wire (docs/contracts.md section 6), facts back out unchanged
    assert json.loads(entry.model_dump_json()) == {
        "bytes": 28_600_000_000, "largest_block_bytes": 703_000_000, "blocks": 40, "nonblock_bytes": 5_000_000,
        "resident_ratio": 0.5,
    }
    assert entry.facts() == facts
    # the family is not on the wire: a described model comes back without it
    assert ModelProfile.of(ModelFacts(bytes=1, largest_block_bytes=1, family="wan")).facts().family == ""
    parsed = NodeProfile.from_annotation(CONTRACT_EXAMPLE).models["wan2.1-14b"].facts()
    assert parsed == ModelFacts(bytes=28_600_000_000, largest_block_bytes=703_000_000, blocks=40)


def test_parse_file_rejects_unknown_keys_by_name_at_any_depth() -> None:
    from dlo.plan.profile import ModelProfile, ProfileError, parse_file

    good = parse_file(NodeProfile, CONTRACT_EXAMPLE, "node.json")
    assert good == NodeProfile.from_annotation(CONTRACT_EXAMPLE)
    doc = json.loads(CONTRACT_EXAMPLE)
    doc["h2d_bandwith_bps"] = 1
    doc["interconnect"]["knd"] = "pcie"
    doc["models"]["wan2.1-14b"]["resident_ration"] = 0.5
    with pytest.raises(ProfileError) as err:
        parse_file(NodeProfile, json.dumps(doc), "node.json")
    message = str(err.value)
    assert message.startswith("node.json: unknown keys") and "\n" not in message
    for key in ("'h2d_bandwith_bps'", "'interconnect.knd'", "'models.wan2.1-14b.resident_ration'"):
        assert key in message
    assert ", ".join(ModelProfile.model_fields) in message  # the keys known at that place
    # an annotation (a newer agent's) still parses leniently
    assert NodeProfile.from_annotation(json.dumps(doc)).h2d_bandwidth_bps == 55300000000
    with pytest.raises(ProfileError, match=r"^c.json: unknown key 'h2d_bandwith_bps' \(known there: "):
        parse_file(CalibrationFragment, '{"h2d_bandwith_bps": 5}', "c.json")
    with pytest.raises(ProfileError, match=r"^c.json: h2d_bandwidth_bps: Input should be greater than 0$"):
        parse_file(CalibrationFragment, '{"h2d_bandwidth_bps": 0}', "c.json")
    with pytest.raises(ProfileError, match=r"^c.json: not JSON"):
        parse_file(CalibrationFragment, "{", "c.json")
