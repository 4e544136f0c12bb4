"""The transformer call's peak is measured on the device that serves: the plan asks for it at every
largest request (and fewer images or frames of it), and one block of the pipeline's own class is
called at each shape as the family's pipeline calls it (on cpu here: the call runs, the numbers are
the GPU's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dlo.plan.memory_model import RequestBounds, Shape, pipeline_memory
from tests.engine.test_family_pipelines import preset_pipeline
from tests.engine.serving_helpers import tiny_pipeline

# the families whose pipeline calls `transformer_inputs` knows (image-to-video: with its image tokens)
PRESETS = ("tiny-wan2.1-t2v", "tiny-wan2.1-i2v", "tiny-flux.1-dev", "tiny-qwen-image")


def _memory(folder: Path, **bounds: int):
    return pipeline_memory(folder, RequestBounds(**{"max_width": 64, "max_height": 48, "max_frames": 9,
                                                    "max_n": 2, "max_sequence_length": 16, **bounds}),
                           tile_above_pixels=10**9)


def test_the_plan_asks_for_the_transformer_at_every_shape_it_weighs(tmp_path_factory) -> None:
    memory = _memory(tiny_pipeline(tmp_path_factory, "wan"))
    points = memory.calibration_shapes()
    calls = {s for p, s in points if p == "transformer"}
    # the largest video and image request, and fewer images and frames of them (where a derived limit falls)
    assert {Shape(64, 48, 9, 1), Shape(64, 48, 1, 2), Shape(64, 48, 1, 1), Shape(64, 48, 5, 1)} <= calls
    assert {s for p, s in points if p == "vae_decode"} == calls  # the same shapes as the plain decodes
    # a measured figure at the largest shape is what the plan takes for it, not the table's
    measured = dict.fromkeys(points, 123)
    assert dataclasses.replace(memory, measured=measured).predicted("transformer", Shape(64, 48, 9, 1)) == (123, False)


@pytest.mark.parametrize("name", PRESETS)
def test_one_block_of_the_pipelines_transformer_runs_at_each_shape(tmp_path_factory, name: str) -> None:
    import torch

    from dlo.engine.families import pipeline_facts
    from dlo.engine.peaks import measurable
    from dlo.engine.peaks_transformer import one_block_transformer, transformer_call

    folder = preset_pipeline(tmp_path_factory, name)
    facts = pipeline_facts(folder)
    module = one_block_transformer(folder, facts.transformer_class, "cpu", torch.bfloat16)
    assert sum(len(blocks) for name, blocks in module.named_children() if "blocks" in name) <= 2  # one of each kind
    shapes = sorted({s for p, s in measurable(folder, _memory(folder).calibration_shapes()) if p == "transformer"},
                    key=lambda s: s.width * s.height * s.frames * s.batch)
    assert len(shapes) >= 2  # images: n and fewer; videos: frames and fewer too
    call = transformer_call(folder, facts, 16, "cpu")
    # what the GPU's reserved-growth measurement runs: one call per shape, its output growing with the
    # tokens the shape carries (the inputs follow the shape as the family's pipeline makes them)
    sizes = [call(s).numel() for s in shapes]
    assert sizes[0] < sizes[-1] and all(v > 0 for v in sizes)
