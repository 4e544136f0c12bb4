"""Cosmos3 and MiniMax-H3 (tiny-cosmos3, tiny-minimax-h3): the call plans are what the pipelines run;
plain diffusers (Cosmos3OmniPipeline, MiniMax-H3's modular pipeline) and the engine's resident dp1,
rank-local dp2 and allgather dp2 (served through `dlo serve` and the official openai SDK) give the
same MP4 / PNG bytes, sound track included; in allgather partial waves the idle rank moves exactly
the bytes the busy one does, for every compatibility key; the API takes each family's frame rules."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest

from dlo.engine.request import Generation
from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.serving_helpers import sha

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

SEED = 11
PROMPT = "a robot arm wiping a plate"
# MiniMax-H3's shortest clip is 124 frames at 24 fps: the small profile's 9 frames would refuse it
MINIMAX_LIMITS = {"max_width": 64, "max_height": 64, "max_steps": 4, "default_steps": 2, "max_frames": 124,
                  "default_size": "32x32", "default_video_size": "32x32", "max_sequence_length": 32}


def png(w: int = 40, h: int = 24) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 10)).save(buf, "PNG")
    return buf.getvalue()


def _write(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    root = tmp_path_factory.getbasetemp() / name
    if not any(root.glob("*model_index.json")):
        write_pipeline(root, preset(name), seed=2)
    return root


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """CPU kernels reduce in an order that depends on the intra-op thread count: the in-process
    pipelines run with the one thread a `dlo serve` rank uses (`--cpu-threads 1`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cosmos(tmp_path_factory):
    return _write(tmp_path_factory, "tiny-cosmos3")


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    return _write(tmp_path_factory, "tiny-minimax-h3")


def _resident(model: Path):
    from dlo.serving.pipeline import ServingPipeline

    return ServingPipeline(model, EngineSettings(OffloadSettings("resident")))


@pytest.fixture(scope="module")
def cosmos_pipe(cosmos):
    return _resident(cosmos)


@pytest.fixture(scope="module")
def minimax_pipe(minimax):
    return _resident(minimax)


COSMOS_T2V = Generation(kind="video", prompt=PROMPT, seed=SEED, width=32, height=32, steps=2, guidance_scale=6.0,
                        frames=9, fps=24)
MINIMAX_T2VA = Generation(kind="video", prompt=PROMPT, seed=SEED, width=32, height=32, steps=3, guidance_scale=1.0,
                          frames=124, fps=24)


def _forwards(pipe, gen: Generation) -> list[str]:
    """The streamed models in the order their first block runs (one entry per forward)."""
    from dlo.engine.families import family_of

    order: list[str] = []
    handles = []
    for name, m in pipe.models.items():
        first = m.module.get_submodule(family_of(type(m.module).__name__).block_lists[0])[0]
        handles.append(first.register_forward_pre_hook(lambda *_, n=name: order.append(n)))
    try:
        pipe.run(gen)
    finally:
        for h in handles:
            h.remove()
    return order


@pytest.mark.parametrize("change", [{}, {"guidance_scale": 1.0}, {"guidance_scale": 0.5}, {"image": b"png"},
                                    {"kind": "image", "frames": 1, "fps": 0}])
def test_cosmos3_calls_match_what_the_pipeline_runs(cosmos_pipe, change):
    """CFG whenever guidance != 1 (0.5 too: the pipeline's own test), i2v and 1-frame images alike."""
    gen = dataclasses.replace(COSMOS_T2V, **{k: png() if v == b"png" else v for k, v in change.items()})
    ran = _forwards(cosmos_pipe, gen)
    assert ran == [c for c, n in cosmos_pipe.call_plan(gen) for _ in range(n)]
    assert len(ran) == gen.steps * (1 if gen.guidance_scale == 1.0 else 2)


def test_minimax_calls_match_what_the_pipeline_runs(minimax):
    """N steps are N - 1 transformer forwards; the streamed Qwen3-VL runs once (no negative prompt)."""
    from dlo.serving.pipeline import ServingPipeline

    pipe = ServingPipeline(minimax, EngineSettings(OffloadSettings("rank-local"), stream_encoders=True))
    for gen in (MINIMAX_T2VA, dataclasses.replace(MINIMAX_T2VA, steps=2),
                dataclasses.replace(MINIMAX_T2VA, image=png())):
        ran = _forwards(pipe, gen)
        assert ran == [c for c, n in pipe.call_plan(gen) for _ in range(n)]
        assert ran == ["text_encoder"] + ["transformer"] * (gen.steps - 1)
    # MiniMax-H3 reads hidden state 50 of `text_encoder.model`: the head never runs and stays off the device
    report = pipe.models["text_encoder"].report
    head = pipe.models["text_encoder"].module.lm_head.weight
    assert report.host_only_bytes >= head.numel() * head.element_size() > 0


def _plain(model: Path, gen: Generation) -> bytes:
    """Plain diffusers (`bench/seed_baseline.py`: Cosmos3OmniPipeline, MiniMax-H3's modular
    pipeline, as a user without accelerate loads them) with the same arguments; the server's encoder."""
    import seed_baseline

    pipe = seed_baseline.load(model, "cpu")
    result = seed_baseline.call(pipe, model, {"prompt": gen.prompt, "seed": gen.seed, "width": gen.width,
                                              "height": gen.height, "steps": gen.steps, "guidance": gen.guidance_scale,
                                              "frames": gen.frames if gen.kind == "video" else 1})
    return seed_baseline.encoded(result)


def test_minimax_vae_decodes_in_tiles_as_released_at_every_size(minimax_pipe, cosmos_pipe):
    """MiniMax-H3's VAE tiles by default (untiled, its output differs): the engine's size rule for
    tiling must not turn it off; Cosmos3's Wan VAE keeps the rule (untiled below it)."""
    assert minimax_pipe.set_vae_tiling(MINIMAX_T2VA) and minimax_pipe.pipe.vae.use_tiling
    assert not cosmos_pipe.set_vae_tiling(COSMOS_T2V) and not cosmos_pipe.pipe.vae.use_tiling


def test_resident_bytes_equal_plain_diffusers_with_the_sound_track(cosmos, minimax, cosmos_pipe, minimax_pipe):
    import imageio_ffmpeg
    import subprocess
    import tempfile

    for model, pipe, gen in ((cosmos, cosmos_pipe, COSMOS_T2V), (minimax, minimax_pipe, MINIMAX_T2VA)):
        served = pipe.run(gen).outputs[0]
        assert sha(served) == sha(_plain(model, gen)), f"{model.name}: the engine's MP4 differs from plain diffusers"
        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
            f.write(served)
            f.flush()
            probe = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", f.name],
                                   capture_output=True, text=True).stderr
        assert "Audio: aac" in probe and "Video: h264" in probe, probe
    image = dataclasses.replace(COSMOS_T2V, kind="image", frames=1, fps=0)
    assert sha(cosmos_pipe.run(image).outputs[0]) == sha(_plain(cosmos, image))


def _moved(srv) -> tuple[dict[str, float], dict[str, float]]:
    m = srv.metrics()
    return ({lab["rank"]: v for lab, v in m["dlo_h2d_bytes_total"]},
            {lab["rank"]: v for lab, v in m["dlo_collective_bytes_total"]})


def _serve(model: Path, mode: str, tmp_path: Path, *limits: str):
    from dlo.serving.launch import ServerProcess

    return ServerProcess(model, "--dp", "2", "--mode", mode, "--device", "cpu", "--progress-timeout", "60",
                         *limits, log_path=tmp_path / f"{model.name}-{mode}.log")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["cosmos3", "minimax-h3"])
def test_served_bytes_equal_resident_in_every_mode_and_idle_ranks_move_what_busy_ones_do(
        family, cosmos, minimax, cosmos_pipe, minimax_pipe, tmp_path):
    """dp 2, one request per wave (rank 1 only gathers): after each request of a new compatibility key
    both ranks have moved the same H2D and collective bytes, and the bytes served (allgather, then
    rank-local) equal the resident pipeline's."""
    from openai import OpenAI

    model, pipe = (cosmos, cosmos_pipe) if family == "cosmos3" else (minimax, minimax_pipe)
    if family == "cosmos3":
        limits: tuple[str, ...] = ("--small-limits",)
        base, steps = COSMOS_T2V, {"num_inference_steps": 2, "guidance_scale": 6.0, "num_frames": 9}
        variants = [{}, {"guidance_scale": 1.0}, {"input_reference": True}, {"image": True}]
    else:
        (tmp_path / "limits.json").write_text(json.dumps(MINIMAX_LIMITS))
        limits = ("--limits", str(tmp_path / "limits.json"))
        base, steps = MINIMAX_T2VA, {"num_inference_steps": 3, "num_frames": 124}
        variants = [{}, {"num_inference_steps": 2}, {"input_reference": True}]

    def request(client, change: dict) -> bytes:
        body = {"seed": SEED, **steps, **{k: v for k, v in change.items() if k not in ("input_reference", "image")}}
        if change.get("image"):  # a 1-frame request: the PNG
            body.pop("num_frames")
            r = client.images.generate(model=model.name, prompt=PROMPT, size="32x32", extra_body=body)
            return base64.b64decode(r.data[0].b64_json or "")
        kw = {"input_reference": ("first.png", png(), "image/png")} if change.get("input_reference") else {}
        job = client.videos.create_and_poll(model=model.name, prompt=PROMPT, size="32x32", extra_body=body, **kw)
        assert job.status == "completed", job.error
        return client.videos.download_content(job.id).read()

    served: dict[str, bytes] = {}
    with _serve(model, "allgather", tmp_path, *limits) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        before = _moved(srv)
        for change in variants:
            out = request(client, change)
            served.setdefault("allgather", out)
            h2d, coll = _moved(srv)
            assert len(set(h2d.values())) == 1 and len(set(coll.values())) == 1, (change, h2d, coll)
            assert h2d["0"] > before[0]["0"], f"{change}: no weight moved"
            before = (h2d, coll)
    with _serve(model, "rank-local", tmp_path, *limits) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        served["rank-local"] = request(client, {})
        assert set(_moved(srv)[1].values()) == {0.0}
    expected = sha(pipe.run(base).outputs[0])
    assert {mode: sha(b) for mode, b in served.items()} == {"allgather": expected, "rank-local": expected}


def test_api_takes_each_familys_frame_rules(cosmos, minimax):
    from dlo.engine.families import PipelineFacts
    from dlo.serving.api_models import (ApiError, ImageGenerationRequest, VideoCreateRequest,
                                               image_generation, video_generation)
    from dlo.plan.limits import Limits

    limits = Limits(**MINIMAX_LIMITS, video_fps=2)
    h3, c3 = PipelineFacts.from_dir(minimax), PipelineFacts.from_dir(cosmos)
    gen = video_generation(VideoCreateRequest(prompt="x", size="32x32"), h3, limits, "m")
    assert (gen.frames, gen.fps) == (124, 24)  # no seconds: the shortest clip, at the model's own 24 fps
    for body, param in (({"num_frames": 125}, "num_frames"), ({"num_frames": 107}, "num_frames"),
                        ({"seconds": "3"}, "seconds"), ({"size": "36x32"}, "size")):
        with pytest.raises(ApiError) as e:
            video_generation(VideoCreateRequest(**{"prompt": "x", "size": "32x32", **body}), h3, limits, "m")
        assert (e.value.status, e.value.param) == (400, param), body
    with pytest.raises(ApiError, match="videos only"):
        image_generation(ImageGenerationRequest(prompt="x", size="32x32"), h3, limits, "m")
    with pytest.raises(ApiError, match="n must be between 1 and 1"):
        image_generation(ImageGenerationRequest(prompt="x", size="32x32", n=2), c3, limits, "m")
    ref = "data:image/png;base64," + base64.b64encode(png()).decode()
    gen = video_generation(VideoCreateRequest(prompt="x", size="32x32", num_frames=9, input_reference=ref), c3,
                           limits, "m")
    assert gen.image == png() and (gen.frames, gen.fps) == (9, 24)  # text- or image-to-video, one family
    # one latent pixel per side is refused (the VAE's attention fails there on cuda), and the warm-up skips it
    from dlo.serving.startup import warmup_generation

    one = f"{c3.size_multiple}x{c3.size_multiple}"
    with pytest.raises(ApiError, match=f"at least {2 * c3.size_multiple}") as e:
        video_generation(VideoCreateRequest(prompt="x", size=one, num_frames=9), c3, limits, "m")
    assert e.value.param == "size"
    smallest = warmup_generation(c3, 1, None)
    assert (smallest.width, smallest.height) == (2 * c3.size_multiple, 2 * c3.size_multiple)
    assert warmup_generation(h3, 1, None).width == h3.size_multiple
    # MiniMax-H3's scheduler needs two steps: one is a 400 on the field, and the warm-up runs two
    with pytest.raises(ApiError, match="between 2 and") as e:
        video_generation(VideoCreateRequest(prompt="x", size="32x32", num_inference_steps=1), h3, limits, "m")
    assert (e.value.status, e.value.param) == (400, "num_inference_steps")
    assert h3.warmup_steps(minimax, 1) == 2 and c3.warmup_steps(cosmos, 1) == 1


def test_safety_checker_is_off_unless_asked_and_sp_is_refused(cosmos, minimax):
    """`--safety-checker` builds Cosmos3's guardrail (absent here: the load names the missing
    package); `--sp 2` exits 2 before any rank starts, naming why each family runs without sp."""
    import subprocess
    import sys

    from dlo.serving.pipeline import ServingPipeline

    with pytest.raises(ImportError, match="cosmos_guardrail"):
        ServingPipeline(cosmos, EngineSettings(OffloadSettings("resident"), safety_checker=True))
    for model, why in ((cosmos, "no _cp_plan"), (minimax, "must divide by sp")):
        r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(model), "--dp", "1", "--sp", "2",
                            "--device", "cpu"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
