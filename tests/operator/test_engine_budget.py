"""spec.engine.maxDeviceMemory and streamDtype (issue 27): `dlo serve` flags of the same names, and
the device budget `spec.mode: auto` plans with."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from dlo.operator import builders, modes
from dlo.operator.models import SpecError, parse_spec

PROFILES = Path(__file__).resolve().parents[2] / "examples" / "profiles"
SPEC = {"model": {"path": "/models/wan2.1-14b"}, "devicesPerNode": 8}


def test_the_budget_and_stream_dtype_are_the_serve_flags_dlo_serve_parses():
    from dlo.serving.serve import add_arguments

    spec = parse_spec({**SPEC, "engine": {"maxDeviceMemory": "24GiB", "streamDtype": "bfloat16"}})
    cmd = builders.engine_command(spec, "rank-local")
    assert cmd[cmd.index("--shutdown-grace") + 2:] == ["--max-device-memory", "24GiB", "--stream-dtype", "bfloat16"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert args.max_device_memory == 24 * 2**30 == spec.engine.device_budget_bytes() and args.stream_dtype == "bfloat16"
    bare = builders.engine_command(parse_spec(SPEC), "rank-local")
    assert "--max-device-memory" not in bare and "--stream-dtype" not in bare


@pytest.mark.parametrize("engine, message", [
    ({"maxDeviceMemory": "24Gi"}, "spec.engine.maxDeviceMemory: String should match pattern"),
    ({"maxDeviceMemory": "0"}, "engine.maxDeviceMemory: must be at least 1 byte"),
    ({"maxDeviceMemory": "24GiB", "device": "cpu"}, "not with engine.device cpu"),
    ({"streamDtype": "fp16"}, "streamDtype"),
    ({"kind": "vllm-omni", "maxDeviceMemory": "24GiB"}, "only with engine.kind dlo"),
])
def test_a_bad_budget_or_dtype_is_an_invalid_spec_naming_the_field(engine, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({**SPEC, "engine": engine})


def test_auto_plans_with_the_spec_budget():
    h200 = json.loads((PROFILES / "h200-node.json").read_text())
    nodes = [{"metadata": {"name": "big", "labels": {}, "annotations": {modes.PROFILE_ANNOTATION: json.dumps(h200)}},
              "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}]
    plain = modes.resolve_mode(parse_spec(SPEC), nodes)
    capped = modes.resolve_mode(parse_spec({**SPEC, "engine": {"maxDeviceMemory": "24GiB"}}), nodes)
    assert plain.mode == "resident" and capped.mode != "resident"
    assert "fits one device" not in capped.reason and capped.inputs != plain.inputs  # a new budget re-resolves
