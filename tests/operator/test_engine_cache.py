"""spec.engine.cache (issue 57): the step cache of a request that names none becomes `dlo serve
--cache` with the preset and the parameters set, which `dlo serve` parses to the same preset; a cache
that is no valid preset is an invalid spec naming the field (in the spec's own names)."""

from __future__ import annotations

import argparse
import json

import pytest

from dlo.engine.cache_presets import Mag, TaylorSeer
from dlo.operator import builders
from dlo.operator.models import SpecError, parse_spec

SPEC = {"model": {"path": "/models/wan2.1-14b"}, "devicesPerNode": 1}


@pytest.mark.parametrize("cache, parsed", [
    ({"preset": "taylorseer", "cacheInterval": 4, "factorsDtype": "float32"},
     TaylorSeer(cache_interval=4, factors_dtype="float32")),
    ({"preset": "mag", "magRatios": [1.0, 0.9, 1.1], "retentionRatio": 0.1},
     Mag(mag_ratios=(1.0, 0.9, 1.1), retention_ratio=0.1)),
])
def test_the_spec_cache_is_the_cache_dlo_serve_parses(cache, parsed):
    from dlo.serving.serve import add_arguments

    spec = parse_spec({**SPEC, "engine": {"cache": cache}})
    cmd = builders.engine_command(spec, "rank-local")
    value = cmd[cmd.index("--cache") + 1]
    assert json.loads(value)["preset"] == cache["preset"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(cmd[2:]).cache == parsed
    assert "--cache" not in builders.engine_command(parse_spec(SPEC), "rank-local")


@pytest.mark.parametrize("cache, message", [
    ({"preset": "fast"}, "spec.engine.cache.preset"),
    ({"preset": "mag"}, "engine.cache.magRatios is required by preset 'mag'"),
    ({"preset": "taylorseer", "threshold": 0.1}, "engine.cache.threshold is no parameter of preset 'taylorseer'"),
    ({"preset": "first-block", "threshold": 0}, "engine.cache.threshold must be a number > 0"),
    ({"preset": "taylorseer", "disableCacheBeforeStep": 0}, "spec.engine.cache.disableCacheBeforeStep"),
])
def test_a_cache_that_is_no_valid_preset_is_an_invalid_spec_naming_the_field(cache, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({**SPEC, "engine": {"cache": cache}})
