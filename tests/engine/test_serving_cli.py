"""`dlo serve` option handling: mode resolution and the API key source."""

from __future__ import annotations

import json

import pytest

from dlo.engine.serving.cli import read_api_key, resolve_mode
from tests.engine.serving_helpers import tiny_pipeline


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_pipeline(tmp_path_factory, "wan")


def test_explicit_mode_is_kept(wan):
    assert resolve_mode("rank-local", wan, 4, "cpu") == ("rank-local", "--mode given")


@pytest.mark.parametrize("dp,mode", [(1, "rank-local"), (2, "allgather")])
def test_auto_without_measured_bandwidth_falls_back_to_the_fixed_rule(wan, dp, mode):
    chosen, why = resolve_mode("auto", wan, dp, "cpu")
    assert chosen == mode and why.startswith("fixed rule")


def test_auto_with_a_calibration_fragment_asks_the_policy(wan, tmp_path):
    frag = tmp_path / "fragment.json"
    frag.write_text(json.dumps({"h2d_bandwidth_bps": 10**10, "collective_bandwidth_bps": 10**9}))
    chosen, why = resolve_mode("auto", wan, 2, "cpu", frag)
    assert why.startswith("policy: ")
    assert chosen == "resident"  # a tiny model fits host memory: nothing to offload on cpu


def test_api_key_from_file_or_environment_never_argv(tmp_path, monkeypatch):
    monkeypatch.setenv("DLO_API_KEY", "from-env")
    assert read_api_key(None) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert read_api_key(f) == "from-file"
    monkeypatch.delenv("DLO_API_KEY")
    assert read_api_key(None) is None


@pytest.mark.parametrize("flags,message", [
    (["--video-ttl", "0"], "TTL must be > 0"),
    (["--video-dir", "FILE"], "video jobs:"),  # a file where the folder should be
])
def test_unusable_video_options_exit_2_before_any_rank_starts(wan, tmp_path, flags, message):
    import subprocess
    import sys

    from tests.engine.serving_helpers import offline_env

    (tmp_path / "FILE").write_text("not a folder")
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    res = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(wan), "--device", "cpu", "--dp", "1",
                          "--mode", "resident", *flags], capture_output=True, text=True, env=offline_env(), timeout=120)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


def test_auto_counts_dp_x_sp_ranks_and_passes_sp_to_the_policy(wan, tmp_path, monkeypatch):
    chosen, why = resolve_mode("auto", wan, 1, "cpu", sp=2)
    assert (chosen, why) == ("allgather", "fixed rule: dp x sp > 1")
    from dlo.agent import policy

    seen = {}
    real = policy.choose_mode

    def spy(*args, **kwargs):
        seen.update(dp=args[2], sp=kwargs.get("sp"))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "choose_mode", spy)
    frag = tmp_path / "fragment.json"
    frag.write_text(json.dumps({"h2d_bandwidth_bps": 10**10, "collective_bandwidth_bps": 10**9}))
    resolve_mode("auto", wan, 1, "cpu", frag, sp=2)
    assert seen == {"dp": 1, "sp": 2}


def test_a_profile_file_with_an_unknown_key_is_refused_naming_it(wan, tmp_path):
    """`--profile` is read as strictly as `dlo plan --profile`: a typo is an error, not a silent
    fall-back to the fixed rule."""
    import subprocess
    import sys

    from tests.engine.serving_helpers import offline_env

    typo = tmp_path / "fragment.json"
    typo.write_text(json.dumps({"h2d_bandwith_bps": 10**10}))
    res = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(wan), "--device", "cpu", "--dp", "1",
                          "--mode", "auto", "--profile", str(typo)], capture_output=True, text=True,
                         env=offline_env(), timeout=120)
    assert res.returncode == 2 and "h2d_bandwith_bps" in res.stderr and "--profile" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
