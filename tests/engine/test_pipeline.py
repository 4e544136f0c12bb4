"""Family adapters: request facts, transformer-call counts (what idle ranks gather), encoding."""

from __future__ import annotations

import dataclasses

import pytest

from dlo.engine.families import PipelineFacts
from dlo.engine.request import Generation
from tests.engine.serving_helpers import sha, tiny_pipeline
from dlo.engine.settings import EngineSettings, OffloadSettings

GEN = Generation(kind="image", prompt="a cat", seed=3, width=32, height=32, steps=2, guidance_scale=5.0)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_pipeline(tmp_path_factory, "wan")


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tiny_pipeline(tmp_path_factory, "flux")


def _serving(model_dir):
    from dlo.serving.pipeline import ServingPipeline

    return ServingPipeline(model_dir, EngineSettings(OffloadSettings("resident")), max_sequence_length=16)


def test_facts_read_from_the_folder_without_torch(wan, flux):
    w, f = PipelineFacts.from_dir(wan), PipelineFacts.from_dir(flux)
    assert (w.family, w.size_multiple, w.temporal_factor, w.supports_video) == ("wan", 16, 4, True)
    assert (f.family, f.size_multiple, f.supports_video) == ("flux", 16, False)


def test_not_a_pipeline_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a diffusers pipeline folder"):
        PipelineFacts.from_dir(tmp_path)


@pytest.mark.parametrize("seconds,fps,frames", [(4, 16, 65), (8, 16, 129), (4, 2, 9), (0.1, 2, 1), (1, 3, 5)])
def test_seconds_map_to_wan_valid_frame_counts(wan, seconds, fps, frames):
    assert PipelineFacts.from_dir(wan).valid_frames(seconds, fps) == frames


@pytest.mark.parametrize(
    "family,change",
    [
        ("wan", {}), ("wan", {"guidance_scale": 1.0}), ("wan", {"steps": 3}), ("wan", {"negative_prompt": "blurry"}),
        ("flux", {}), ("flux", {"negative_prompt": "blurry"}),
        ("flux", {"negative_prompt": "blurry", "guidance_scale": 1.0}),
    ],
)
def test_transformer_call_count_matches_what_the_pipeline_runs(tmp_path_factory, family, change):
    pipe = _serving(tiny_pipeline(tmp_path_factory, family))
    calls = [0]
    pipe.pipe.transformer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    gen = dataclasses.replace(GEN, **change)
    pipe.run(gen)
    assert calls[0] == pipe.facts.transformer_calls(gen) > 0


def test_same_seed_same_png_bytes_different_seed_different_bytes(wan):
    pipe = _serving(wan)
    a, b = pipe.run(GEN), pipe.run(GEN)
    c = pipe.run(dataclasses.replace(GEN, seed=4))
    assert a.media_type == "image/png" and a.outputs[0].startswith(b"\x89PNG")
    assert sha(a.outputs[0]) == sha(b.outputs[0]) != sha(c.outputs[0])
    assert len(a.step_seconds) == GEN.steps


def test_n_images_per_request_and_video_as_mp4(wan):
    pipe = _serving(wan)
    two = pipe.run(dataclasses.replace(GEN, n=2))
    assert len(two.outputs) == 2 and two.outputs[0] != two.outputs[1]
    video = pipe.run(dataclasses.replace(GEN, kind="video", frames=5, fps=2))
    assert video.media_type == "video/mp4" and len(video.outputs) == 1
    assert video.outputs[0][4:8] == b"ftyp"
    again = pipe.run(dataclasses.replace(GEN, kind="video", frames=5, fps=2))
    assert sha(video.outputs[0]) == sha(again.outputs[0])


def test_component_sizes_are_reported(wan):
    pipe = _serving(wan)
    assert set(pipe.component_bytes) == {"vae", "text_encoder"}
    assert all(v > 0 for v in pipe.component_bytes.values())
