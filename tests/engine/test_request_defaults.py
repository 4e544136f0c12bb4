"""A request that omits steps, size or frames gets the family's default clamped to the limits, never
a 400 (serving/served_limits.py); limits no request could honour are refused at `dlo serve`'s start
in one line (exit 2)."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys

import pytest
import requests

from dlo.engine.families import PipelineFacts
from dlo.plan.limits import SMALL, Limits
from dlo.serving.served_limits import LimitsError, default_frames, default_size, default_steps, limits_problem, load_limits
from tests.engine.serving_helpers import offline_env, tiny_pipeline, wait_until

WAN = PipelineFacts("wan", "WanPipeline", 16, 4, 5.0, "WanTransformer3DModel")
# a model of videos only whose clips are 17k+5 frames, 124 to 364 at 24 fps (MiniMax-H3's rule)
CLIPS = PipelineFacts("minimax-h3", "MiniMaxH3ModularPipeline", 32, 4, 1.0, "MiniMaxH3Transformer3DModel",
                      frame_step=17, frame_offset=5, min_frames=124, max_frames=345, fps=24, images=False,
                      min_steps=2)


def test_omitted_fields_get_the_default_clamped_to_the_limits():
    limits = Limits(max_steps=2, max_width=512, max_height=512, max_frames=17)
    assert default_steps(WAN, limits) == 2  # default_steps 30, max_steps 2
    assert default_size(WAN, limits) == (512, 512)  # 1024x1024 scaled into 512x512
    assert default_size(WAN, limits, video=True) == (512, 288)  # 832x480 keeps its aspect, multiples of 16
    assert default_frames(WAN, limits, 16) == 17  # 4 s at 16 fps is 65 frames: the longest 4k+1 within 17
    assert default_frames(WAN, limits.model_copy(update={"max_frames": 20}), 16) == 17
    within = Limits()
    assert (default_steps(WAN, within), default_size(WAN, within), default_size(WAN, within, video=True),
            default_frames(WAN, within, 16)) == (30, (1024, 1024), (832, 480), 65)  # unchanged within the limits
    assert default_size(WAN, Limits(max_width=1920, max_height=64), video=True) == (112, 64)
    assert default_steps(CLIPS, Limits(max_steps=4, default_steps=1)) == 2  # never below the model's fewest
    assert default_frames(CLIPS, Limits(max_frames=200), 24) == 124  # its shortest clip (5.2 s), not 4 s


@pytest.mark.parametrize("facts,limits,field,fragment", [
    (WAN, Limits(max_width=100, max_height=100), "max_width", "not a multiple of 16 (WanPipeline sizes are "
                                                               "multiples of 16): use 96 or 112"),
    (WAN, Limits(max_height=1000), "max_height", "max_height 1000 is not a multiple of 16"),
    (WAN, Limits(default_size="1000x1000"), "default_size", "default_size 1000x1000: width and height must be "
                                                            "multiples of 16"),
    (WAN, Limits(default_video_size="840x480"), "default_video_size", "multiples of 16"),
    (CLIPS, Limits(max_width=16, max_height=16), "max_width", "max_width 16 is not a multiple of 32"),
    (CLIPS, Limits(max_steps=1), "max_steps", "max_steps 1 is below 2"),
    (CLIPS, Limits(max_frames=100), "max_frames", "below 124 frames, the shortest clip"),
])
def test_limits_no_request_could_honour_are_named(facts, limits, field, fragment):
    problem = limits_problem(facts, limits)
    assert problem is not None and problem[0] == field and fragment in problem[1], problem


def test_default_and_small_limits_suit_every_family():
    for facts in (WAN, CLIPS):
        assert limits_problem(facts, Limits(max_frames=364)) is None
    assert limits_problem(WAN, SMALL) is None


def test_loading_names_the_flag_or_the_file(tmp_path):
    with pytest.raises(LimitsError, match=r"^--max-size 100: max_width 100 is not a multiple of 16"):
        load_limits(None, False, None, 100, WAN)
    with pytest.raises(LimitsError, match=r"^--limits .*missing\.json: no such file$"):
        load_limits(tmp_path / "missing.json", False, None, None, WAN)
    bad = tmp_path / "limits.json"
    bad.write_text(json.dumps({"max_width": 100}))
    with pytest.raises(LimitsError, match=r"^--limits .*limits\.json: max_width 100 is not a multiple"):
        load_limits(bad, False, None, None, WAN)
    bad.write_text("{not json")
    with pytest.raises(LimitsError, match=r"^--limits .*: not a JSON or YAML mapping of limits"):
        load_limits(bad, False, None, None, WAN)
    bad.write_text(json.dumps({"max_stepz": 3}))
    with pytest.raises(LimitsError, match=r"^--limits .*: max_stepz: Extra inputs are not permitted"):
        load_limits(bad, False, None, None, WAN)


def _png_size(png: bytes) -> tuple[int, int]:
    return struct.unpack(">II", png[16:24])


@pytest.mark.slow
def test_a_served_request_without_steps_size_or_frames_gets_the_clamped_default(tmp_path_factory):
    """SMALL's defaults (2 steps, 64x64, 4 s = 9 frames at 2 fps) above `--max-steps 1 --max-size 32`
    and a file's max_frames 5: each omitted field is clamped, through real HTTP."""
    from dlo.serving.launch import ServerProcess

    model = tiny_pipeline(tmp_path_factory, "wan")
    tmp = tmp_path_factory.mktemp("defaults")
    (tmp / "limits.json").write_text(json.dumps({**SMALL.model_dump(), "max_frames": 5}))
    with ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--limits",
                       str(tmp / "limits.json"), "--max-steps", "1", "--max-size", "32",
                       log_path=tmp / "serve.log") as srv:
        assert srv.ready_info()["warmup_size"] == "32x32"  # what a request without size gets
        r = requests.post(srv.url + "/v1/images/generations", json={"prompt": "a red bicycle", "seed": 1}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert _png_size(base64.b64decode(r.json()["data"][0]["b64_json"])) == (32, 32)
        v = requests.post(srv.url + "/v1/videos", json={"prompt": "a red bicycle", "seed": 1}, timeout=60)
        assert v.status_code == 200, v.text[:300]
        job = v.json()
        assert (job["size"], job["seconds"]) == ("32x32", "2.5")  # 5 frames at 2 fps
        wait_until(lambda: requests.get(f"{srv.url}/v1/videos/{job['id']}", timeout=10).json()["status"]
                   in ("completed", "failed"), 60, "the video job ends")
        assert requests.get(f"{srv.url}/v1/videos/{job['id']}", timeout=10).json()["status"] == "completed"
        explicit = requests.post(srv.url + "/v1/images/generations", json={"prompt": "x", "num_inference_steps": 2},
                                 timeout=60)
        assert explicit.status_code == 400 and explicit.json()["error"]["param"] == "num_inference_steps"


@pytest.mark.slow
def test_a_size_limit_off_the_size_multiple_is_refused_at_start_in_one_line(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(model), "--device", "cpu",
                        "--small-limits", "--max-size", "100"], capture_output=True, text=True, env=offline_env(),
                       timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0] == ("dlo serve: --max-size 100: max_width 100 is not a multiple of 16 (WanPipeline sizes are "
                        "multiples of 16): use 96 or 112")
