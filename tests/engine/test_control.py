"""The control plane's messages, the service's domain errors and their HTTP mapping, torch-free."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from dlo.engine.report import LoadReport
from dlo.serving import control
from dlo.serving.control import RankConfig, RankStats, summary
from dlo.engine.settings import EngineSettings, OffloadSettings, ParallelSettings
from dlo.serving.errors import (
    EngineFailed,
    EngineUnavailable,
    InvalidInput,
    QueueFull,
    RequestFailed,
    ServiceError,
    ShuttingDown,
)
from dlo.engine.request import Generation

GEN = Generation(kind="image", prompt="a lighthouse", seed=1, width=64, height=64, steps=2, guidance_scale=5.0)
REPORT = LoadReport(mode="allgather", weights_source="arena", blocks=3, largest_block_bytes=10, host_pinned_bytes=20,
                    slot_bytes=40, resident_bytes=5, load_seconds=0.1, shard_group_size=2, rank=1)
MESSAGES = [
    control.Hello(1, 1234),
    control.Ready(control.RankFacts(REPORT, {"vae": 7}), RankStats(gathers=1)),
    control.StepProgress(2),
    control.Result(3, RankStats(gathers=9, h2d_bytes=4), (b"png",), "image/png", (0.1, 0.2), 0.3),
    control.Result(3, RankStats()),
    control.Result(3, RankStats(), error=control.RequestError("decode", "RuntimeError", "boom")),
    control.RankFailure("rank 1 failed"),
    control.WaveAssignment(3, GEN, None),
    control.WaveAssignment(3, GEN, GEN),
    control.Stop(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_is_a_frozen_dataclass_that_pickles_as_is(msg):
    assert dataclasses.is_dataclass(msg) and type(msg).__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert not isinstance(msg, dict)
    assert pickle.loads(pickle.dumps(msg)) == msg
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, dataclasses.fields(msg)[0].name if dataclasses.fields(msg) else "x", None)


def test_rank_config_round_trips_through_the_environment_json():
    settings = EngineSettings(OffloadSettings("allgather", resident_blocks="auto", transfer="peer"),
                              ParallelSettings(dp=2, sp=2, ulysses_exchange="lean", gather_max_ctas=8))
    cfg = RankConfig(model_dir="/m", settings=settings, master_port=1, control_port=2)
    back = RankConfig.from_json(cfg.to_json())
    assert back == cfg and back.settings.offload.transfer == "peer" and back.world == 4


def test_ready_summary_is_the_json_of_slash_ready():
    s = summary(1, MESSAGES[1])  # type: ignore[arg-type]
    assert s["rank"] == 1 and s["report"]["weights_source"] == "arena" and s["components"] == {"vae": 7}
    assert s["stats"]["gathers"] == 1
    assert summary(2, None) == {"rank": 2}


def test_rank_stats_are_the_gather_counters_plus_the_peak_with_the_same_json():
    from dlo.engine.report import GatherStats

    total = GatherStats.total([GatherStats(1, 2, 3, 0.5), GatherStats(4, 5, 6, 0.25)])
    assert total == GatherStats(5, 7, 9, 0.75) and GatherStats.total([]) == GatherStats()
    stats = RankStats.of(total, 11)
    assert isinstance(stats, GatherStats)  # one definition of the counters, extended by the peak
    # /ready's and the metrics' per-rank `stats` stay one flat object
    assert dataclasses.asdict(stats) == {"gathers": 5, "h2d_bytes": 7, "collective_bytes": 9,
                                         "gather_wait_seconds": 0.75, "device_memory_peak_bytes": 11,
                                         "device_energy_joules": None,  # no NVML counter given: unknown, not 0
                                         "block_calls_skipped": 0, "bytes_not_streamed": 0}  # no step cache


def test_control_and_errors_import_neither_torch_nor_fastapi():
    code = ("import sys, dlo.serving.control, dlo.serving.errors, dlo.engine.report; "
            "bad = [m for m in ('torch', 'fastapi') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert control.WaveError.__module__ == "dlo.serving.control"


@pytest.mark.parametrize("err,status,code", [
    (QueueFull("full"), 429, "queue_full"),
    (EngineUnavailable("loading"), 503, "not_ready"),
    (EngineFailed("rank 1 died"), 503, "engine_failed"),
    (ShuttingDown("bye"), 503, "shutting_down"),
    (ServiceError("?"), 500, "service_error"),
    (RequestFailed("decode failed"), 500, "generation_failed"),
    (InvalidInput("bad text"), 400, "invalid_input"),
])
def test_the_server_maps_each_domain_error_to_one_status(err, status, code):
    from dlo.serving.server import api_error, status_of

    assert status_of(err) == status
    api = api_error(err)
    assert (api.status, api.code, api.message) == (status, code, err.message)


def test_the_service_speaks_no_http():
    from pathlib import Path

    import dlo.serving.service as service

    text = Path(service.__file__).read_text()
    assert "ApiError" not in text and "fastapi" not in text.lower()
