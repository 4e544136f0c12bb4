"""The start's warm-up on a rank (`dlo.serving.warm_run`): where the family can say what its
decode is, the VAE decodes on the calling thread (the one later requests run on) while the text
encoding and the denoising run beside it; later requests' bytes are those of a rank that never
warmed up; a failure on either side is raised once both are done."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dlo.engine.request import Generation
from dlo.engine.settings import EngineSettings, OffloadSettings
from dlo.serving.startup import warmup_generation
from dlo.serving.warm_run import run_warm_up
from tests.engine.serving_helpers import tiny_pipeline

pytestmark = pytest.mark.slow


def _pipeline(model):
    from dlo.serving.pipeline import ServingPipeline

    return ServingPipeline(model, EngineSettings(OffloadSettings("rank-local")), max_sequence_length=16)


def _threads_of(module: torch.nn.Module, seen: set[int]) -> None:
    module.register_forward_pre_hook(lambda *_: seen.add(threading.get_ident()))


def test_the_warm_up_decodes_on_the_calling_thread_beside_its_denoising(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    pipe = _pipeline(model)
    warm = warmup_generation(pipe.facts, 1, None, 2)
    assert warm.warmup and pipe.adapter.decode_beside_warmup
    # the call's own decode at the request's shape: the frames the pipeline returns for it
    with torch.inference_mode():
        zero = np.asarray(pipe.adapter.warm_decode(pipe.pipe, warm).frames)
        real = np.asarray(pipe.pipe(**pipe.pipeline_kwargs(warm)).frames)
    assert zero.shape == real.shape and zero.dtype == real.dtype
    decode_threads: set[int] = set()
    denoise_threads: set[int] = set()
    _threads_of(pipe.pipe.vae.decoder, decode_threads)
    _threads_of(pipe.model.module, denoise_threads)
    res = run_warm_up(pipe, warm)
    assert decode_threads == {threading.get_ident()}  # the decode: here, and only here
    assert denoise_threads and threading.get_ident() not in denoise_threads  # the transformer: beside
    assert res.media_type == "image/png" and res.outputs[0].startswith(b"\x89PNG")
    assert set(res.phase_seconds) == {"decode", "encode_output", "wait", "denoise_beside"}
    assert res.phase_seconds["denoise_beside"] <= res.seconds
    assert pipe.steps_done == warm.steps and pipe.phase == "idle"
    # a later request's bytes: those of a pipeline that never warmed up
    gen = Generation(kind="image", prompt="a lighthouse", seed=3, width=32, height=32, steps=2, guidance_scale=5.0)
    cold = _pipeline(model)
    assert pipe.run(gen).outputs == cold.run(gen).outputs
    cold.close()
    pipe.close()


def test_a_failure_beside_is_raised_once_both_sides_are_done(tmp_path_factory, monkeypatch):
    model = tiny_pipeline(tmp_path_factory, "wan")
    pipe = _pipeline(model)
    warm = warmup_generation(pipe.facts, 1, None, 2)
    decoding = threading.Event()
    real_decode = pipe.adapter.warm_decode

    def slow_decode(p, g):
        decoding.set()
        return real_decode(p, g)

    def broken(*_a, **_k):
        assert decoding.wait(30)
        raise RuntimeError("transformer broke")

    monkeypatch.setattr(pipe.adapter, "warm_decode", slow_decode)
    hook = pipe.model.module.register_forward_pre_hook(broken)
    with pytest.raises(RuntimeError, match="transformer broke"):
        run_warm_up(pipe, warm)
    assert not any(t.name == "dlo-warmup-denoise" for t in threading.enumerate())
    hook.remove()

    def no_decode(p, g):
        raise ValueError("decode broke")

    monkeypatch.setattr(pipe.adapter, "warm_decode", no_decode)
    with pytest.raises(ValueError, match="decode broke"):
        run_warm_up(pipe, warm)
    assert not any(t.name == "dlo-warmup-denoise" for t in threading.enumerate())  # the call beside ended first
    pipe.close()
