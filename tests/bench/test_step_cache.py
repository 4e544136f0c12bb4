"""`python -m bench step-cache`'s own arithmetic: SSIM (1 for the same frame, lower the more noise),
the difference of two PNGs or MP4s from a cached answer to the uncached one, the counters' growth
per cache, and each ratio's two sides."""

from __future__ import annotations

import io

import numpy as np

from bench.step_cache import frames_drift, ratios, saved, ssim


def _png(a: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_ssim_is_one_for_the_same_frame_and_falls_with_noise():
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (48, 64, 3)).astype(np.float64)
    assert abs(ssim(frame, frame) - 1.0) < 1e-9
    light, heavy = (np.clip(frame + rng.normal(0, s, frame.shape), 0, 255) for s in (5, 60))
    assert 1.0 > ssim(frame, light) > ssim(frame, heavy) > 0.0


def test_a_cached_png_against_the_uncached_one():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 200, (32, 32, 3))
    b = a.copy()
    b[:12, :12] += rng.integers(0, 10, (12, 12, 3))
    b[0, 0, 0] = a[0, 0, 0] + 9
    same, diff = frames_drift(_png(a), _png(a)), frames_drift(_png(a), _png(b))
    assert same["max_abs_levels"] == 0 and same["psnr_db"] is None and same["ssim"] == 1.0
    assert diff["max_abs_levels"] == 9 and diff["psnr_db"] > 40 and diff["ssim"] < 1.0


def test_counters_grow_per_cache_per_request_and_ratios_pair_one_call():
    secs = {"first": 2.0, "median": 2.0, "min": 2.0, "max": 2.0, "n": 2}
    rec = {"serve_capped": {"none": {"seconds": {**secs, "first": 4.4, "median": 4.0},
                                     "counters": {"block_calls_skipped": 0.0, "bytes_not_streamed": 0.0}},
                            "taylorseer": {"seconds": secs,
                                           "counters": {"block_calls_skipped": 100.0, "bytes_not_streamed": 7e9}}},
           "diffusers_resident": {"none": {"seconds": {**secs, "median": 3.0}}}}
    got = saved(rec, {"none": {}, "taylorseer": {}})
    assert got["serve_capped:taylorseer"] == {"block_calls_skipped": 50.0, "bytes_not_streamed": 3.5e9}
    r = ratios(rec)["serve_capped:taylorseer"]
    assert r["speedup_over_uncached_median"] == 2.0 and r["speedup_over_uncached_first"] == 2.2
    assert r["over_diffusers_resident_none"] == round(2.0 / 3.0, 3)
