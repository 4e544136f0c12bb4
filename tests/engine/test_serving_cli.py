"""`dlo serve` option handling: the plan's mode resolution and the API key source."""

from __future__ import annotations

import json

import pytest

from dlo.serving.serve import read_api_key
from tests.engine.serving_helpers import plan_mode as resolve_mode, tiny_pipeline


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
    (["--warmup-steps", "0"], "--warmup-steps"),
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
    from dlo.plan import policy

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


def test_a_device_budget_no_mode_fits_exits_2_before_anything_loads(wan, tmp_path):
    """`--mode auto` over a node whose device budget is below every mode's weights: one line naming
    what does not fit and the smallest budget that would, exit 2, no rank started."""
    import subprocess
    import sys

    from tests.engine.serving_helpers import offline_env

    profile = tmp_path / "node.json"
    profile.write_text(json.dumps({
        "version": "v1", "node": "small", "h2d_bandwidth_bps": 25 * 10**9, "host_memory_bytes": 10**12,
        "accelerator": {"vendor": "nvidia", "model": "test", "count": 1, "memory_bytes": 80 * 10**9,
                        "budget_bytes": 100_000}}))
    res = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(wan), "--device", "cpu", "--dp", "1",
                          "--mode", "auto", "--profile", str(profile), "--small-limits"],
                         capture_output=True, text=True, env=offline_env(), timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("dlo serve: --mode auto: no mode fits") and "the smallest device budget that fits is" in line
    assert "Traceback" not in res.stderr and "loaded" not in res.stderr  # refused before any load


def test_a_given_mode_is_checked_against_the_budget():
    from pathlib import Path

    from dlo.plan.facts import ModelFacts
    from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds
    from dlo.plan.memory_table import MemoryTable
    import dataclasses

    from dlo.plan.budget import DeviceBudgetError, check_mode, local_budget
    from dlo.plan.memory_model import largest_requests

    t = ModelFacts(bytes=28_640_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=500_000_000)
    table = MemoryTable.load(Path(__file__).parent / "fixtures" / "memory_table_small.json")
    memory = PipelineMemory("wan", Geometry(16, 4), {"transformer": t}, {}, {"vae": 508_000_000},
                            RequestBounds(1920, 1920, 129), 1280 * 720 * 81, table)
    assert memory.rank("rank-local").extrapolated  # beyond the measured shapes: a guess, never a refusal
    guess = memory.rank("rank-local").peak_bytes
    assert "extrapolated" in check_mode("rank-local", memory, guess - 1, 1)
    # measured on this device at the largest request's shapes: the same bytes now refuse
    measured = {(p, s): memory.predicted(p, s, table_only=True)[0] for p, s in
                [("transformer", s) for s in largest_requests(memory.bounds, memory.geometry)]
                + [("vae_decode_tiled", s) for s in largest_requests(memory.bounds, memory.geometry)]
                + [("vae_decode", s) for s in largest_requests(memory.bounds, memory.geometry)]
                + [("vae_decode", memory._largest_plain(s)) for s in largest_requests(memory.bounds, memory.geometry)
                   if memory._largest_plain(s) is not None]}
    memory = dataclasses.replace(memory, measured=measured)
    assert not memory.rank("rank-local").extrapolated and memory.rank("rank-local").peak_bytes == guess
    assert local_budget(150 * 10**9, 0, memory) == 150 * 10**9 - 500_000_000  # the context lives outside
    assert local_budget(150 * 10**9, 24 * 2**30, memory) == 24 * 2**30  # a cap is the allocator's own
    peak = memory.rank("rank-local").peak_bytes
    assert "fits the device budget" in check_mode("rank-local", memory, peak, 1)
    with pytest.raises(DeviceBudgetError) as err:
        check_mode("rank-local", memory, peak - 1, 1)
    assert f"the smallest budget that fits --mode rank-local is {peak / 1e9:.1f} GB" in str(err.value)
    assert "--max-size" in str(err.value) and "1920x1920x129" in str(err.value)
    with pytest.raises(DeviceBudgetError, match="--mode resident does not fit"):
        check_mode("resident", memory, 24 * 2**30, 1)
    unmeasured = PipelineMemory("wan", Geometry(16, 4), {"transformer": t}, {}, {}, RequestBounds(832, 480, 17),
                                1280 * 720 * 81, MemoryTable())
    weights = unmeasured.rank("rank-local").weights_bytes
    assert "less than 15% left" in check_mode("rank-local", unmeasured, weights + 1, 1)  # a warning, not a refusal
    with pytest.raises(DeviceBudgetError, match="needs 1.9 GB"):
        check_mode("rank-local", unmeasured, weights - 1, 1)  # the weights alone: certain to fail
