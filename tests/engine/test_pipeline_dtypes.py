"""Real pipelines store the transformer and text encoders in bfloat16 and serve the VAE in float32
(its output becomes the bytes). The tiny presets are float32 throughout, so this runs bfloat16 twins
of them: the other components load in the transformer's compute dtype in every mode (streamed blocks
counted, float32-kept norms not deciding), and latents meet the float32 VAE in its own dtype."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dlo.engine.request import Generation
from tests.engine.serving_helpers import sha
from dlo.engine.settings import EngineSettings, OffloadSettings


def bf16_twin(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    root = tmp_path_factory.getbasetemp() / f"{name}-bf16"
    if not (root / "model_index.json").exists():
        p = preset(name)
        comps = tuple(c if c.name.startswith("vae") else dataclasses.replace(c, dtype="bfloat16")
                      for c in p.components)
        write_pipeline(root, dataclasses.replace(p, components=comps), seed=3)
    return root


@pytest.mark.parametrize("name", ["tiny-flux.1-dev", "tiny-wan2.1-t2v"])
def test_bf16_pipeline_serves_in_every_mode_with_its_encoders_in_bf16(tmp_path_factory, name):
    from dlo.serving.pipeline import ServingPipeline

    model = bf16_twin(tmp_path_factory, name)
    video = "wan" in name
    gen = Generation(kind="video" if video else "image", prompt="a lighthouse", seed=5, width=32, height=32,
                     steps=2, guidance_scale=5.0, frames=5 if video else 1, fps=2 if video else 0)
    shas = {}
    for mode in ("resident", "rank-local"):
        pipe = ServingPipeline(model, EngineSettings(OffloadSettings(mode)), max_sequence_length=16)
        try:
            assert pipe.model.compute_dtype == torch.bfloat16
            for comp_name, comp in pipe.pipe.components.items():
                if comp_name.startswith("text_encoder"):
                    assert {p.dtype for p in comp.parameters()} == {torch.bfloat16}, comp_name
            assert {p.dtype for p in pipe.pipe.vae.parameters()} == {torch.float32}
            shas[mode] = sha(pipe.run(gen).outputs[0])
        finally:
            pipe.close()
    assert shas["resident"] == shas["rank-local"]
