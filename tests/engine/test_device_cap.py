"""`dlo serve --max-device-memory` (byte sizes, refusals where no cap can apply) and the per-component
report (weights source, host bytes, device bytes) of every component."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dlo.cli.args import byte_size
from tests.engine.test_family_pipelines import preset_pipeline
from dlo.engine.settings import EngineSettings, OffloadSettings


@pytest.mark.parametrize("text,value", [("25769803776", 24 * 2**30), ("24GiB", 24 * 2**30), ("24GB", 24 * 10**9),
                                        ("1.5MiB", 3 * 2**19), ("512", 512), ("2 TiB", 2 * 2**40)])
def test_byte_sizes(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "24XB", "-1GiB", "0", "nan", "24 GiBs"])
def test_bad_byte_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_cap_refused_on_cpu():
    from dlo.engine.platform import cap_device_memory

    with pytest.raises(ValueError, match="needs a cuda or npu device"):
        cap_device_memory("cpu", 2**30)


def test_serve_refuses_the_cap_on_cpu_before_any_rank_starts(tmp_path_factory):
    model = preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v")
    r = subprocess.run([sys.executable, "-m", "cli.main", "serve", str(model), "--device", "cpu",
                        "--max-device-memory", "24GiB"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-device-memory needs a cuda or npu device" in r.stderr, r.stderr


def test_every_component_is_reported(tmp_path_factory):
    from dlo.serving.pipeline import ServingPipeline
    from dlo.serving.rank_main import ready_message

    for name, comps in [("tiny-wan2.2-t2v-a14b", {"transformer", "transformer_2", "text_encoder", "vae"}),
                        ("tiny-flux.1-dev", {"transformer", "text_encoder", "text_encoder_2", "vae"})]:
        pipe = ServingPipeline(preset_pipeline(tmp_path_factory, name), EngineSettings(OffloadSettings("rank-local")),
                               max_sequence_length=16)
        reports = ready_message(pipe).facts.component_reports
        assert set(reports) == comps
        for comp, r in reports.items():
            assert set(r) == {"weights_source", "host_bytes", "device_bytes"} and r["device_bytes"] > 0, (comp, r)
        assert reports["transformer"]["weights_source"] == "arena" and reports["transformer"]["host_bytes"] > 0
        assert reports["vae"]["weights_source"] == "resident"
        pipe.close()
