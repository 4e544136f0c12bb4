"""Step-cache presets as a request, a flag and the server settings give them (torch-free): a name,
an object or its JSON text; each parameter checked with the field named; the settings carry a default
to the ranks unchanged; a wave with a cache marks every request of it, and a cache never splits a wave."""

from __future__ import annotations

import json

import pytest

from dlo.engine.cache_presets import CacheSpecError, FirstBlock, Mag, TaylorSeer, cache_dict, cache_spec, listing
from dlo.engine.request import Generation
from dlo.engine.settings import EngineSettings, OffloadSettings
from dlo.serving.waves import Pending, compatibility_key, mark_caches


def test_a_cache_is_a_name_an_object_or_its_json_and_none_is_none():
    assert cache_spec("first-block") == FirstBlock() and cache_spec(None) is None and cache_spec("none") is None
    assert cache_spec({"preset": "none"}) is None
    spec = cache_spec('{"preset": "taylorseer", "cache_interval": 2, "factors_dtype": "float32"}')
    assert spec == TaylorSeer(cache_interval=2, factors_dtype="float32")
    mag = cache_spec({"preset": "mag", "mag_ratios": [1, 0.5], "threshold": 0.1})
    assert mag == Mag(mag_ratios=(1, 0.5), threshold=0.1)
    assert cache_spec(cache_dict(mag)) == mag and json.loads(json.dumps(cache_dict(mag))) == cache_dict(mag)


@pytest.mark.parametrize("value, param", [
    ("fast", "cache.preset"), ({"threshold": 0.1}, "cache.preset"), (3, "cache"), ("{not json", "cache"),
    ({"preset": "first-block", "threshold": 0}, "cache.threshold"),
    ({"preset": "first-block", "threshold": True}, "cache.threshold"),
    ({"preset": "first-block", "threshold": float("nan")}, "cache.threshold"),
    ({"preset": "first-block", "max_order": 1}, "cache.max_order"),
    ({"preset": "taylorseer", "cache_interval": 0}, "cache.cache_interval"),
    ({"preset": "taylorseer", "disable_cache_before_step": 0}, "cache.disable_cache_before_step"),
    ({"preset": "taylorseer", "max_order": 5}, "cache.max_order"),
    ({"preset": "taylorseer", "factors_dtype": "float16"}, "cache.factors_dtype"),
    ({"preset": "mag"}, "cache.mag_ratios"), ({"preset": "mag", "mag_ratios": [1]}, "cache.mag_ratios"),
    ({"preset": "mag", "mag_ratios": [1, -1]}, "cache.mag_ratios[1]"),
    ({"preset": "mag", "mag_ratios": [1, 1], "retention_ratio": 2}, "cache.retention_ratio"),
])
def test_a_cache_that_is_no_valid_preset_names_the_field(value, param):
    with pytest.raises(CacheSpecError) as e:
        cache_spec(value)
    assert e.value.param == param and str(e.value).startswith(param), str(e.value)


def test_the_listing_gives_each_preset_with_diffusers_defaults_and_the_server_default():
    shown = listing(FirstBlock(threshold=0.2))
    assert shown["default"] == {"preset": "first-block", "threshold": 0.2}
    assert shown["presets"]["taylorseer"]["cache_interval"] == 5 and shown["presets"]["mag"]["mag_ratios"] is None


def test_the_server_default_reaches_the_ranks_unchanged():
    settings = EngineSettings(OffloadSettings("resident"), cache=Mag(mag_ratios=(1.0, 0.9)))
    assert EngineSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings


def test_a_cache_marks_its_wave_and_never_splits_one():
    plain = Generation(kind="image", prompt="p", seed=1, width=32, height=32, steps=2, guidance_scale=5.0)
    cached = Generation(kind="image", prompt="p", seed=2, width=32, height=32, steps=2, guidance_scale=5.0,
                        cache=FirstBlock())
    assert compatibility_key(plain) == compatibility_key(cached)
    wave = mark_caches([Pending(plain, 0.0), Pending(cached, 0.0)])
    assert [p.gen.wave_caches for p in wave] == [True, True] and wave[1].gen.cache == FirstBlock()
    assert [p.gen.wave_caches for p in mark_caches([Pending(plain, 0.0)])] == [False]


def test_a_video_request_takes_its_cache_as_json_text_as_a_multipart_form_sends_it(tmp_path_factory):
    from dlo.engine.families import pipeline_facts
    from dlo.plan.limits import SMALL
    from dlo.serving.api_models import ApiError, VideoCreateRequest, video_generation
    from tests.engine.serving_helpers import tiny_pipeline

    facts = pipeline_facts(tiny_pipeline(tmp_path_factory, "wan"))

    def video(cache: str, default=None) -> Generation:
        body = VideoCreateRequest.model_validate({"prompt": "p", "num_frames": "5", "cache": cache})
        return video_generation(body, facts, SMALL, "m", (), default)

    assert video('{"preset": "first-block", "threshold": 0.2}').cache == FirstBlock(threshold=0.2)
    assert video("none", default=FirstBlock()).cache is None
    with pytest.raises(ApiError) as e:
        video('{"preset": "mag"}')
    assert e.value.status == 400 and e.value.param == "cache.mag_ratios"
