"""dlo.engine.settings: every engine switch typed and validated once (`ConfigError` naming it), the
one reader of the `DLO_*` variables, `dlo serve`'s flags over them, the round trip to the child
ranks, and the rules that keep the environment out of the core."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.serving_helpers import serve_settings

from dlo.engine.settings import (
    ENVIRONMENT,
    ConfigError,
    EngineSettings,
    OffloadSettings,
    ParallelSettings,
    from_environment,
    split_overrides,
)

ENGINE = Path(__file__).resolve().parents[2] / "engine"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"mode": "sideways"}, "mode must be one of allgather, rank-local, resident, got 'sideways'"),
    ({"mode": "rank-local", "resident_blocks": -1}, "resident_blocks must be 'auto' or an integer >= 0, got -1"),
    ({"mode": "rank-local", "resident_blocks": "many"}, "resident_blocks must be 'auto' or an integer >= 0"),
    ({"mode": "rank-local", "resident_blocks": True}, "resident_blocks must be 'auto' or an integer >= 0, got True"),
    ({"mode": "rank-local", "weights": "pinned"}, "weights must be one of auto, arena, registered, got 'pinned'"),
    ({"mode": "allgather", "transfer": "nccl"}, "transfer must be one of collective, peer, got 'nccl'"),
    ({"mode": "allgather", "transfer_graphs": "yes"}, "transfer_graphs must be true or false (or unset)"),
    ({"mode": "allgather", "register_early": 0}, "register_early must be true or false, got 0"),
])
def test_a_bad_offload_setting_is_refused_naming_it(kwargs, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        OffloadSettings(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"dp": 0}, "dp must be an integer >= 1, got 0"),
    ({"sp": 1.5}, "sp must be an integer >= 1, got 1.5"),
    ({"sp_kind": "tree"}, "sp_kind must be one of ulysses, ring, got 'tree'"),
    ({"ulysses_exchange": "fast"}, "ulysses_exchange must be one of overlap, lean, diffusers, got 'fast'"),
    ({"gather_max_ctas": 65}, "gather_max_ctas must be an integer from 1 to 64, got 65"),
    ({"gather_max_ctas": 0}, "gather_max_ctas must be an integer from 1 to 64, got 0"),
])
def test_a_bad_parallel_setting_is_refused_naming_it(kwargs, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        ParallelSettings(**kwargs)


def test_engine_settings_check_their_device_rules():
    with pytest.raises(ConfigError, match="device must be one of cpu, cuda, npu, got 'tpu'"):
        EngineSettings(OffloadSettings("resident"), device="tpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_device_memory needs a cuda or npu device"):
        EngineSettings(OffloadSettings("resident"), max_device_memory=1 << 30)
    assert EngineSettings(OffloadSettings("resident"), device="cuda", max_device_memory=1 << 30).max_device_memory


def test_settings_are_frozen_and_round_trip_as_plain_data():
    s = EngineSettings(OffloadSettings("allgather", resident_blocks="auto", transfer="peer", register_early=False),
                       ParallelSettings(dp=2, sp=2, ulysses_exchange="lean", gather_max_ctas=8),
                       device="cuda", max_device_memory=24 << 30, stream_encoders=True, cpu_threads=2)
    assert EngineSettings.from_dict(s.to_dict()) == s
    with pytest.raises(AttributeError):
        s.offload.mode = "resident"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="do not parse"):
        EngineSettings.from_dict({**s.to_dict(), "colour": "blue"})
    assert s.offload.but(mode="rank-local").mode == "rank-local" and s.offload.mode == "allgather"


@pytest.mark.parametrize("env, want", [
    ({}, {}),
    ({"DLO_GATHER": "", "DLO_ULYSSES": " "}, {}),  # empty is unset (a template's default)
    ({"DLO_GATHER": " peer "}, {"transfer": "peer"}),
    ({"DLO_GATHER_MAX_CTAS": "16"}, {"gather_max_ctas": 16}),
    ({"DLO_ULYSSES": "diffusers", "DLO_REGISTER_EARLY": "0"}, {"ulysses_exchange": "diffusers", "register_early": False}),
    ({"DLO_REGISTER_EARLY": "1", "DLO_API_KEY": "secret", "DLO_POD_NAME": "p"}, {"register_early": True}),
])
def test_the_environment_sets_only_what_its_variables_name(env, want):
    assert from_environment(env) == want


@pytest.mark.parametrize("name, raw, fragment", [
    ("DLO_GATHER", "nccl", "DLO_GATHER must be one of collective, peer, got 'nccl'"),
    ("DLO_GATHER", "Peer", "DLO_GATHER must be one of collective, peer, got 'Peer'"),
    ("DLO_ULYSSES", "1", "DLO_ULYSSES must be one of overlap, lean, diffusers, got '1'"),
    ("DLO_GATHER_MAX_CTAS", "0", "DLO_GATHER_MAX_CTAS must be an integer from 1 to 64"),
    ("DLO_GATHER_MAX_CTAS", "65", "DLO_GATHER_MAX_CTAS must be an integer from 1 to 64"),
    ("DLO_GATHER_MAX_CTAS", "2.5", "got '2.5'"),
    ("DLO_GATHER_MAX_CTAS", "\u0664", "got '\u0664'"),  # a non-ASCII digit
    ("DLO_REGISTER_EARLY", "off", "DLO_REGISTER_EARLY must be 0 or 1, got 'off'"),
])
def test_a_bad_variable_is_refused_naming_it(name, raw, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        from_environment({name: raw})


def test_every_variable_names_a_setting_and_a_serve_flag():
    from dlo.serving.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for name, var in ENVIRONMENT.items():
        assert var.flag in flags, (name, var.flag)
        split_overrides({var.setting: None})  # a field of OffloadSettings or ParallelSettings


@pytest.mark.parametrize("argv, env, transfer, exchange, early", [
    ([], {}, "collective", "overlap", True),  # the defaults
    ([], {"DLO_GATHER": "peer", "DLO_ULYSSES": "lean", "DLO_REGISTER_EARLY": "0"}, "peer", "lean", False),
    (["--gather", "collective", "--ulysses-exchange", "diffusers", "--register-early"],
     {"DLO_GATHER": "peer", "DLO_ULYSSES": "lean", "DLO_REGISTER_EARLY": "0"}, "collective", "diffusers", True),
    (["--no-register-early"], {"DLO_REGISTER_EARLY": "1"}, "collective", "overlap", False),
])
def test_a_serve_flag_wins_over_its_variable_which_wins_over_the_default(argv, env, transfer, exchange, early):
    s = serve_settings(["--sp", "2", *argv], "allgather", "cpu", 1, env)
    assert (s.offload.transfer, s.parallel.ulysses_exchange, s.offload.register_early) == (transfer, exchange, early)
    assert (s.parallel.dp, s.parallel.sp, s.offload.mode, s.device) == (1, 2, "allgather", "cpu")


def test_cta_cap_flag_over_variable():
    s = serve_settings([], "allgather", "cuda", 2, {"DLO_GATHER_MAX_CTAS": "4"})
    assert s.parallel.gather_max_ctas == 4
    s = serve_settings(["--gather-max-ctas", "8"], "allgather", "cuda", 2, {"DLO_GATHER_MAX_CTAS": "4"})
    assert s.parallel.gather_max_ctas == 8


def test_settings_import_no_torch():
    code = "import sys, dlo.engine.settings; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _core_sources() -> list[Path]:
    return [*ENGINE.glob("*.py"), *(ENGINE / "families").glob("*.py")]


def test_the_core_reads_no_environment_outside_settings():
    """CONVENTIONS: one reader of the environment; the core gets typed settings passed down."""
    pattern = re.compile(r"os\.environ|getenv\(|environ\.get\(")
    offenders = [f"{p.relative_to(ENGINE.parent)}:{n}" for p in _core_sources() if p.name != "settings.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == [], offenders


def test_no_arg_type_ignores_under_engine():
    offenders = [f"{p.relative_to(ENGINE.parent)}:{n}" for p in ENGINE.rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if "type: ignore[arg-type]" in line]
    assert offenders == [], offenders
