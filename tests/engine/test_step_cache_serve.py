"""Step caches through `dlo serve` (real processes, gloo ranks, real HTTP, the official openai SDK):
`"cache"` on a request, each preset the bytes of plain diffusers with the same cache configuration in
every multi-rank mode: allgather dp 2 with a cached request beside an uncached one and two presets in
one wave (each rank's cache is its request's own; a block no rank runs is gathered by none, a rank
that only gathers takes part in what the cached request runs and nothing more), and sp 2 (a cache's
hooks under the context-parallel ones, First Block Cache deciding on the whole sequence); `dlo serve --cache` is the default of a
request that names none ("none" runs none); a cache that is no valid preset is a 400 naming the
field; GET /v1/models lists the presets and the default."""

from __future__ import annotations

import base64
import json

import openai
import pytest
from openai import OpenAI

from dlo.serving.launch import ServerProcess
from tests.engine.cache_helpers import SIZE, STEPS, CacheSetup, cache_setup  # noqa: F401  (the fixture)
from tests.engine.serving_helpers import submit_in_order

pytestmark = pytest.mark.slow
WINDOW_MS = 800  # two requests sent together land in one wave even on a loaded 2-core machine


def _image(client: OpenAI, model: str, seed: int, cache=None) -> bytes:
    extra = {"seed": seed, "num_inference_steps": STEPS, "guidance_scale": 5.0}
    if cache is not None:
        extra["cache"] = cache
    r = client.images.generate(model=model, prompt="a lighthouse", size=f"{SIZE}x{SIZE}", response_format="b64_json",
                               extra_body=extra)
    return base64.b64decode(r.data[0].b64_json or "")


def _one_wave(srv: ServerProcess, fns: list) -> list[bytes]:
    """Send `fns` together (arrival order = rank order) and check they ran as ONE wave of that size."""
    def waves() -> tuple[float, float]:
        m = srv.metrics()
        return m["dlo_wave_size_count"][0][1], m["dlo_wave_size_sum"][0][1]

    before = waves()
    outs = submit_in_order(srv.url, fns, seconds=120)
    after = waves()
    assert (after[0] - before[0], after[1] - before[1]) == (1, len(fns)), "the requests did not share one wave"
    return outs


def _counters(srv: ServerProcess) -> dict[str, dict[str, float]]:
    """Per metric of the step caches (and the H2D bytes), per rank."""
    m = srv.metrics()
    return {name: {lab["rank"]: v for lab, v in m[name]} for name in (
        "dlo_cache_block_calls_skipped_total", "dlo_cache_bytes_not_streamed_total", "dlo_h2d_bytes_total",
        "dlo_device_slot_bytes")}


def _delta(after: dict, before: dict, name: str) -> dict[str, float]:
    return {r: after[name][r] - before[name].get(r, 0.0) for r in after[name]}


def _server(s: CacheSetup, tmp_path, *flags: str) -> ServerProcess:
    return ServerProcess(s.model, "--device", "cpu", "--small-limits", "--max-steps", str(STEPS), "--no-warmup",
                         "--wave-window-ms", str(WINDOW_MS), *flags, log_path=tmp_path / "serve.log")


def test_allgather_dp2_cached_and_uncached_requests_share_waves_and_equal_diffusers(cache_setup, tmp_path):
    s = cache_setup
    with _server(s, tmp_path, "--dp", "2", "--mode", "allgather") as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        card = client.models.list().data[0]
        mid, caches = card.id, getattr(card, "caches")
        assert sorted(caches["presets"]) == ["first-block", "mag", "taylorseer"] and caches["default"] is None
        assert caches["presets"]["first-block"] == {"threshold": 0.05}  # diffusers' default
        # a cached request beside an uncached one, either way round, and two presets in one wave
        fb, plain = _one_wave(srv, [lambda: _image(client, mid, 1, s.request("first-block")),
                                    lambda: _image(client, mid, 2)])
        assert fb == s.ref_bytes("first-block", 1) and plain == s.ref_bytes("none", 2)
        plain, mag = _one_wave(srv, [lambda: _image(client, mid, 1, "none"),
                                     lambda: _image(client, mid, 2, s.request("mag"))])
        assert plain == s.ref_bytes("none", 1) and mag == s.ref_bytes("mag", 2)
        taylor, fb = _one_wave(srv, [lambda: _image(client, mid, 2, s.request("taylorseer")),
                                     lambda: _image(client, mid, 2, s.request("first-block"))])
        assert taylor == s.ref_bytes("taylorseer", 2) and fb == s.ref_bytes("first-block", 2)
        assert fb != s.ref_bytes("none", 2)  # the cache did change the image
        # a skipped block is streamed by no rank: the rank that only gathers takes part in the gathers the
        # cached request needs and nothing more (MagCache skips whole calls: every block of them)
        before = _counters(srv)
        assert _image(client, mid, 1, s.request("mag")) == s.ref_bytes("mag", 1)
        after, counts = _counters(srv), s.ref_counts("mag", 1)
        skipped = counts["block_calls"] - counts["block_runs"]
        assert _delta(after, before, "dlo_cache_block_calls_skipped_total") == {"0": skipped, "1": 0}
        block = after["dlo_device_slot_bytes"]["0"] / 2  # two slots of one (padded) block: the tiny blocks are alike
        assert _delta(after, before, "dlo_cache_bytes_not_streamed_total") == {"0": skipped * block, "1": skipped * block}
        h2d = _delta(after, before, "dlo_h2d_bytes_total")
        assert h2d["0"] == h2d["1"] > 0  # the same gathers on both ranks (the text encoder's too)
        # a cache that is no valid preset: 400 naming the field
        for bad, param in [("fast", "cache.preset"), ({"preset": "first-block", "threshold": -1}, "cache.threshold"),
                           ({"preset": "first-block", "cache_interval": 2}, "cache.cache_interval"),
                           ({"preset": "mag"}, "cache.mag_ratios"), (7, "cache"),
                           ({"preset": "taylorseer", "disable_cache_before_step": 0},
                            "cache.disable_cache_before_step")]:
            with pytest.raises(openai.BadRequestError) as e:
                _image(client, mid, 1, bad)
            assert e.value.status_code == 400 and e.value.body["param"] == param, (bad, e.value.body)


def test_sp2_each_preset_equals_diffusers_and_the_server_default_is_dlo_serve_cache(cache_setup, tmp_path):
    s = cache_setup
    with _server(s, tmp_path, "--sp", "2", "--mode", "allgather", "--cache", json.dumps(s.request("mag"))) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        card = client.models.list().data[0]
        mid = card.id
        assert getattr(card, "caches")["default"] == {**s.request("mag"), "max_skip_steps": 3, "retention_ratio": 0.2}
        for cache in ("first-block", "taylorseer"):
            assert _image(client, mid, 1, s.request(cache)) == s.ref_bytes(cache, 1), cache
        assert _image(client, mid, 1) == s.ref_bytes("mag", 1)  # the server's default
        assert _image(client, mid, 1, "none") == s.ref_bytes("none", 1)
        # a video: the SDK sends multipart form data, a nested cache as `cache[preset]`, `cache[threshold]`,
        # `cache[mag_ratios][]` per item - folded back into the object (numbers read as numbers), applied
        video = {"seed": 1, "num_inference_steps": STEPS, "guidance_scale": 5.0, "num_frames": 5}
        skipped = sum(v for _, v in srv.metrics()["dlo_cache_block_calls_skipped_total"])
        job = client.videos.create_and_poll(model=mid, prompt="a lighthouse", size=f"{SIZE}x{SIZE}", poll_interval_ms=50,
                                            extra_body={**video, "cache": s.request("first-block")})
        assert job.status == "completed", job.error
        assert sum(v for _, v in srv.metrics()["dlo_cache_block_calls_skipped_total"]) > skipped
        with pytest.raises(openai.BadRequestError) as e:
            client.videos.create(model=mid, prompt="a lighthouse", size=f"{SIZE}x{SIZE}",
                                 extra_body={**video, "cache": {"preset": "first-block", "threshold": 0}})
        assert e.value.body["param"] == "cache.threshold", e.value.body
