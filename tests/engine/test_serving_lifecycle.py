"""`dlo serve` start and stop: every rank warms up before /ready, an idle server exits 0 on SIGTERM.

Real processes (rank 0 + a child rank over gloo) and real HTTP. The teardown these tests guard is the
one that hung on NCCL (allgather mode): ranks leave the process group together and bounded.
"""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline
from tests.reliability.procs import survivors

pytestmark = pytest.mark.slow

EXIT_WITHIN_S = 10.0  # issue goal for an idle server on SIGTERM, in every mode


@pytest.mark.parametrize("mode,dp", [("allgather", 2), ("rank-local", 2), ("resident", 1)])
def test_idle_server_warms_up_then_exits_zero_on_sigterm(tmp_path_factory, tmp_path, mode, dp):
    model = tiny_pipeline(tmp_path_factory, "wan")
    log = tmp_path / "serve.log"
    srv = ServerProcess(model, "--dp", str(dp), "--mode", mode, "--device", "cpu", "--small-limits", log_path=log)
    srv.start(ready_timeout_s=240)
    try:
        ready = srv.ready_info()
        # Warm-up ran on every rank before ready: its seconds are reported.
        assert ready["warmup_seconds"] is not None and ready["warmup_seconds"] > 0
        assert ready["warmup_size"] == "64x64"  # the small limits' default_size: what a request without size gets
        # where the time to ready went: every phase measured, together no more than the process's age
        st = ready["startup_seconds"]
        assert st["before_load"] > 0 and st["load"] > 0 and st["warmup"] > 0
        assert st["before_load"] + st["load"] + st["warmup"] <= st["total"] + 0.05
        # and where the load and the warm-up went, per phase (rank 0's; each rounded to 10 ms)
        phases = st["phases"]
        load_steps = {"device_init", "process_group", "imports", "engine_models", "from_pretrained", "settle"}
        # Wan's warm-up decodes on the wave thread beside its text encoding and denoising (warm_run.py):
        # those one after another on the wave thread, and the call beside them
        warm_steps = {"warmup_decode", "warmup_encode_output", "warmup_wait"}
        assert load_steps <= set(phases) and warm_steps | {"warmup_denoise_beside"} <= set(phases), phases
        assert sum(v for k, v in phases.items() if not k.startswith("warmup_")) <= st["load"] + 0.1
        assert 0 < sum(phases[k] for k in warm_steps) <= st["warmup"] + 0.05
        assert 0 < phases["warmup_denoise_beside"] <= st["warmup"] + 0.05
        assert ready["ranks"][0]["load_phases"] == {k: v for k, v in phases.items() if not k.startswith("warmup_")}
        # and before the load: `dlo serve`'s steps in order, adding up to before_load (each rounded to 10 ms)
        before = st["before_load_phases"]
        assert list(before) == ["before_checks", "listen", "model_and_limits", "layout", "library_warmup",
                                "plan", "video_store", "engine", "rank_spawn_and_http_server"], before
        assert abs(sum(before.values()) - st["before_load"]) <= 0.06 and all(v >= 0 for v in before.values())
        # the deployment plan the server runs (dlo.plan.deployment), as `dlo plan --json` prints it
        plan = ready["plan"]
        assert (plan["mode"], plan["dp"], plan["sp"], plan["device"]) == (mode, dp, 1, "cpu")
        assert plan["mode_reason"] == "--mode given" and plan["budget_bytes"] is None  # cpu ranks: no budget
        assert plan["limits"]["max_width"] == 128 and "transformer" in plan["predicted_peak_bytes"]
        assert plan["vae"]["reason"] == "no device budget on cpu: the fixed rule"
        # Warm-up is not a client request: no wave or request metric counts it.
        metrics = srv.metrics()
        assert not any(v for _, v in metrics.get("dlo_wave_size_count", []))
        if mode != "resident":
            # /ready's stats are each rank's at load (the first block of each streamed model);
            # /metrics counts since: every rank's warm-up moved more weight bytes on top of them.
            assert len(ready["ranks"]) == dp
            h2d = {labels["rank"]: v for labels, v in metrics["dlo_h2d_bytes_total"]}
            for r in ready["ranks"]:
                assert h2d[str(r["rank"])] > r["stats"]["h2d_bytes"] > 0, (r["rank"], h2d, r["stats"])
        tree = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        assert len(tree) >= dp
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=EXIT_WITHIN_S + 20)
        exited = time.monotonic() - t0
        left = survivors(tree, 5.0)
    finally:
        srv.stop()
    assert rc == 0, log.read_text()[-3000:]
    assert not left, f"processes left behind: {left}"
    print(json.dumps({"mode": mode, "dp": dp, "exit_seconds": round(exited, 2),
                      "warmup_seconds": round(ready["warmup_seconds"], 3)}))
    assert exited <= EXIT_WITHIN_S, f"{mode} dp{dp} took {exited:.1f} s to exit after SIGTERM"
    assert "warmup_seconds=" in log.read_text()


def test_no_warmup_flag_reports_none(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    with ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--small-limits",
                       "--no-warmup", log_path=tmp_path / "serve.log") as srv:
        assert srv.ready_info()["warmup_seconds"] is None and srv.ready_info()["warmup_size"] is None


def test_warmup_at_the_smallest_size(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    with ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--small-limits",
                       "--warmup-size", "smallest", "--warmup-steps", "2", log_path=tmp_path / "serve.log") as srv:
        info = srv.ready_info()
        assert info["warmup_size"] == "16x16" and info["warmup_steps"] == 2 and info["warmup_seconds"] > 0
