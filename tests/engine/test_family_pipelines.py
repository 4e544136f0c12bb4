"""The families of the tiny-* presets (Wan2.1 I2V, Wan2.2 two experts, Qwen-Image, Flux.1-dev layout):
transformer calls per transformer and compatibility key as the pipeline runs them; served bytes equal
to the resident pipeline in-process across modes and dp, with the gathers of idle ranks in step
(equal counters on every rank after partial waves); `input_reference` through the official SDK."""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path

import pytest

from dlo.engine.request import Generation
from dlo.serving.waves import compatibility_key
from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.serving_helpers import sha

SEED = 77


def preset_pipeline(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    root = tmp_path_factory.getbasetemp() / name
    if not (root / "model_index.json").exists():
        write_pipeline(root, preset(name), seed=1)
    return root


def png(w: int = 40, h: int = 24, color=(200, 30, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def _gen(name: str, **change) -> Generation:
    video = "wan" in name
    base = Generation(kind="video" if video else "image", prompt="a lighthouse", seed=SEED, width=32, height=32,
                      steps=4, guidance_scale=5.0, frames=5 if video else 1, fps=2 if video else 0,
                      image=png() if "i2v" in name else None)
    return dataclasses.replace(base, **change)


@pytest.mark.parametrize("name,change", [
    ("tiny-wan2.2-t2v-a14b", {}), ("tiny-wan2.2-t2v-a14b", {"guidance_scale": 1.0}),
    ("tiny-wan2.2-t2v-a14b", {"steps": 3}), ("tiny-wan2.1-i2v", {}), ("tiny-qwen-image", {}),
    ("tiny-qwen-image", {"negative_prompt": "blurry"}), ("tiny-flux.1-dev", {"negative_prompt": "blurry"}),
])
def test_calls_per_transformer_match_what_the_pipeline_runs(tmp_path_factory, name, change):
    from dlo.serving.pipeline import ServingPipeline

    pipe = ServingPipeline(preset_pipeline(tmp_path_factory, name), EngineSettings(OffloadSettings("resident")),
                           max_sequence_length=16)
    order: list[str] = []
    for comp, m in pipe.models.items():
        m.module.register_forward_pre_hook(lambda *_, c=comp: order.append(c))
    gen = _gen(name, **change)
    pipe.run(gen)
    ran = [(c, order.count(c)) for c in dict.fromkeys(order)]  # components in first-run order, with counts
    plan = [(c, n) for c, n in pipe.call_plan(gen) if n]
    assert ran == plan and sum(n for _, n in plan) == pipe.facts.transformer_calls(gen)
    assert order == [c for c, n in plan for _ in range(n)], "an expert ran out of the plan's order"
    if name.startswith("tiny-wan2.2") and gen.steps == 4:
        assert len(plan) == 2, "both experts must run: the boundary falls inside the schedule"


def test_the_warm_up_runs_both_of_wan22s_experts(tmp_path_factory, tmp_path):
    """One warm-up step runs only Wan2.2's high-noise expert: its steps grow to the fewest whose
    schedule reaches the low-noise one (3 with the full model's flow shift of 12, 2 for the tiny preset)."""
    import json

    from dlo.engine.families import PipelineFacts
    from dlo.engine.presets import PRESETS

    tiny = PipelineFacts.from_dir(preset_pipeline(tmp_path_factory, "tiny-wan2.2-t2v-a14b"))
    assert tiny.adapter.warmup_steps(preset_pipeline(tmp_path_factory, "tiny-wan2.2-t2v-a14b"), 1) == 2
    full = PRESETS["wan2.2-t2v-a14b"]
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": full.scheduler[0], **full.scheduler[1]}))
    (tmp_path / "model_index.json").write_text(json.dumps(full.index_extras))
    assert [tiny.adapter.warmup_steps(tmp_path, n) for n in (1, 2, 3, 5)] == [3, 3, 3, 5]
    wan = PipelineFacts.from_dir(preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v"))
    assert wan.adapter.warmup_steps(tmp_path, 1) == 1  # one transformer: the steps asked for


def test_families_are_recognised_from_the_folders(tmp_path_factory):
    from dlo.engine.families import PipelineFacts

    facts = {n: PipelineFacts.from_dir(preset_pipeline(tmp_path_factory, n)) for n in
             ("tiny-wan2.1-t2v", "tiny-wan2.1-i2v", "tiny-wan2.2-t2v-a14b", "tiny-flux.1-dev", "tiny-qwen-image")}
    assert {n: f.family for n, f in facts.items()} == {
        "tiny-wan2.1-t2v": "wan", "tiny-wan2.1-i2v": "wan-i2v", "tiny-wan2.2-t2v-a14b": "wan2.2",
        "tiny-flux.1-dev": "flux", "tiny-qwen-image": "qwen-image"}
    assert facts["tiny-wan2.2-t2v-a14b"].transformers == ("transformer", "transformer_2")
    assert facts["tiny-wan2.1-i2v"].image_input and not facts["tiny-wan2.1-t2v"].image_input
    assert (facts["tiny-qwen-image"].size_multiple, facts["tiny-qwen-image"].supports_video) == (16, False)
    from dlo.engine.blocks import describe

    t5 = describe(preset_pipeline(tmp_path_factory, "tiny-flux.1-dev") / "text_encoder_2")  # torch-free facts
    assert (t5.family, t5.blocks) == ("t5-encoder", 2)


def test_input_reference_validation():
    from dlo.engine.families import PipelineFacts
    from dlo.serving.api_models import ApiError, VideoCreateRequest, video_generation
    from dlo.plan.limits import SMALL

    t2v = PipelineFacts("wan", "WanPipeline", 16, 4, 5.0, "WanTransformer3DModel")
    i2v = dataclasses.replace(t2v, family="wan-i2v", pipeline_class="WanImageToVideoPipeline", image_input=True)
    ref = "data:image/png;base64," + base64.b64encode(png()).decode()
    with pytest.raises(ApiError, match="not supported by model") as e:
        video_generation(VideoCreateRequest(prompt="x", input_reference=ref), t2v, SMALL, "m")
    assert (e.value.status, e.value.param) == (400, "input_reference")
    with pytest.raises(ApiError, match="is required"):
        video_generation(VideoCreateRequest(prompt="x"), i2v, SMALL, "m")
    for bad in (b"not an image", png()[:40], "data:image/png;base64,@@@"):
        with pytest.raises(ApiError, match="input_reference") as e:
            video_generation(VideoCreateRequest(prompt="x", input_reference=bad), i2v, SMALL, "m")
        assert e.value.status == 400
    gen = video_generation(VideoCreateRequest(prompt="x", input_reference=ref, size="32x32"), i2v, SMALL, "m")
    assert gen.image == png() and "image" not in compatibility_key(gen)


@pytest.mark.parametrize("name", ["tiny-wan2.1-t2v", "tiny-flux.1-dev", "tiny-qwen-image"])
def test_streamed_text_encoders_give_the_same_bytes_and_follow_the_call_plan(tmp_path_factory, name):
    """UMT5 / T5 through `dlo.engine.load` (`encoder.block`, tied embedding bound once) in rank-local
    mode: same bytes as the whole encoder, and its forwards (prompt, negative) are in the call plan."""
    from dlo.serving.pipeline import ServingPipeline

    model = preset_pipeline(tmp_path_factory, name)
    gen = _gen(name, kind="image", frames=1, fps=0, negative_prompt="blurry", steps=2)
    ref = ServingPipeline(model, EngineSettings(OffloadSettings("resident")), max_sequence_length=16).run(gen).outputs[0]
    pipe = ServingPipeline(model, EngineSettings(OffloadSettings("rank-local"), stream_encoders=True), max_sequence_length=16)
    order: list[str] = []
    for comp, m in pipe.models.items():
        m.module.register_forward_pre_hook(lambda *_, c=comp: order.append(c))
    assert sha(pipe.run(gen).outputs[0]) == sha(ref)
    enc = pipe.encoders[0]
    assert order == [c for c, n in pipe.call_plan(gen) for _ in range(n)] and order.count(enc) == 2
    report = pipe.component_reports()[enc]
    assert report["weights_source"] == "arena" and report["host_bytes"] > 0


@pytest.mark.parametrize("name", ["tiny-wan2.1-t2v", "tiny-flux.1-dev", "tiny-qwen-image"])
def test_resident_mode_loads_the_large_text_encoder_through_the_engine_with_the_same_bytes(tmp_path_factory, name):
    """`stream_encoders` in resident mode: the large encoder is one of the engine's models (its
    copies read the registered page cache on a GPU), resident whole, and the bytes are those of
    diffusers' own load of it."""
    from dlo.serving.pipeline import ServingPipeline

    model = preset_pipeline(tmp_path_factory, name)
    gen = _gen(name, kind="image", frames=1, fps=0, negative_prompt="blurry", steps=2)
    whole = ServingPipeline(model, EngineSettings(OffloadSettings("resident")), max_sequence_length=16)
    pipe = ServingPipeline(model, EngineSettings(OffloadSettings("resident"), stream_encoders=True), max_sequence_length=16)
    enc = pipe.encoders[0]
    assert enc in pipe.models and enc not in pipe.component_bytes and enc in whole.component_bytes
    assert pipe.models[enc].report.blocks == 0 and pipe.component_reports()[enc]["weights_source"] == "resident"
    assert sha(pipe.run(gen).outputs[0]) == sha(whole.run(gen).outputs[0])


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,flags", [
    # the large text encoder streams by default; --no-stream-text-encoders keeps it whole on every rank
    ("tiny-wan2.2-t2v-a14b", "allgather", ("--no-stream-text-encoders",)),
    ("tiny-wan2.2-t2v-a14b", "rank-local", ("--no-stream-text-encoders",)),
    ("tiny-qwen-image", "allgather", ("--no-stream-text-encoders",)), ("tiny-wan2.1-i2v", "allgather", ()),
    ("tiny-wan2.2-t2v-a14b", "allgather", ()),
    ("tiny-flux.1-dev", "allgather", ()),
    ("tiny-qwen-image", "allgather", ()),
])
def test_served_bytes_equal_resident_in_process_and_idle_ranks_gather_as_often(tmp_path_factory, tmp_path, name,
                                                                                mode, flags):
    """dp 2, partial waves (rank 1 only gathers): the bytes equal the in-process resident pipeline
    (dp 1) and every rank's gather counters are equal after them."""
    from openai import OpenAI

    from dlo.serving.launch import ServerProcess
    from dlo.serving.pipeline import ServingPipeline

    model = preset_pipeline(tmp_path_factory, name)
    srv = ServerProcess(model, "--dp", "2", "--mode", mode, "--device", "cpu", "--small-limits",
                        "--progress-timeout", "60", *flags, log_path=tmp_path / "serve.log")
    with srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        if "wan" in name:
            kw = {"input_reference": ("first.png", png(), "image/png")} if "i2v" in name else {}
            job = client.videos.create_and_poll(model=model.name, prompt="a lighthouse", size="32x32", seconds="2",
                                                extra_body={"seed": SEED, "num_inference_steps": 4,
                                                            "guidance_scale": 5.0}, **kw)
            assert job.status == "completed", job.error
            served = client.videos.download_content(job.id).read()
            gen = _gen(name, frames=5, fps=2)  # --small-limits: 2 fps, "2" seconds = 5 frames
        else:
            r = client.images.generate(model=model.name, prompt="a lighthouse", size="32x32",
                                       response_format="b64_json",
                                       extra_body={"seed": SEED, "num_inference_steps": 4, "guidance_scale": 5.0,
                                                   "negative_prompt": "blurry"})
            served = base64.b64decode(r.data[0].b64_json or "")
            gen = _gen(name, negative_prompt="blurry")
        info = srv.ready_info()
        m = srv.metrics()
        by_rank = {labels["rank"]: v for labels, v in m["dlo_collective_bytes_total"]}
        h2d = {labels["rank"]: v for labels, v in m["dlo_h2d_bytes_total"]}
    assert srv.proc is not None and srv.proc.returncode == 0
    if mode == "allgather":  # rank-local ranks without a request move nothing (no collective to keep in step)
        assert len(set(by_rank.values())) == 1 and min(by_rank.values()) > 0, by_rank
        assert len(set(h2d.values())) == 1, f"ranks moved different byte counts: {h2d}"
    else:
        assert set(by_rank.values()) == {0.0}
    enc = "text_encoder_2" if "flux" in name else "text_encoder"  # Qwen-Image: Qwen2.5-VL
    # streamed (the default) or whole (--no-stream-text-encoders), as every rank reports it
    source = "resident" if "--no-stream-text-encoders" in flags else "arena"
    assert all(r["component_reports"][enc]["weights_source"] == source for r in info["ranks"])
    local = ServingPipeline(model, EngineSettings(OffloadSettings("resident")), max_sequence_length=SMALL_SEQ)
    expected = local.run(gen).outputs[0]
    assert sha(served) == sha(expected), f"{name} {mode}: served bytes differ from the resident pipeline"


SMALL_SEQ = 32


def test_vae_decodes_in_tiles_above_the_size_limit_and_stays_deterministic(tmp_path_factory):
    from dlo.serving.pipeline import VAE_TILE_ABOVE_PIXELS, ServingPipeline

    pipe = ServingPipeline(preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v"),
                           EngineSettings(OffloadSettings("resident")), max_sequence_length=16)
    gen = _gen("tiny-wan2.1-t2v", steps=2)
    assert not pipe.set_vae_tiling(gen) and not pipe.pipe.vae.use_tiling
    assert pipe.set_vae_tiling(dataclasses.replace(gen, width=1280, height=720, frames=81 + 4))
    assert VAE_TILE_ABOVE_PIXELS == 1280 * 720 * 81
    pipe.vae_tile_above_pixels = 0  # every request tiled: the tiny VAE decodes in tiles of its own size
    pipe.pipe.vae.tile_sample_min_height = pipe.pipe.vae.tile_sample_min_width = 16
    pipe.pipe.vae.tile_sample_stride_height = pipe.pipe.vae.tile_sample_stride_width = 8
    a, b = pipe.run(gen), pipe.run(gen)
    assert pipe.pipe.vae.use_tiling and sha(a.outputs[0]) == sha(b.outputs[0])
