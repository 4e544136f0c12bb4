"""Family registry and checkpoint key grouping."""

import pytest

from dlo.engine.blocks import describe, group_keys
from dlo.engine.families import BLOCK_FAMILIES, FAMILIES, family_of


def test_flux_blocks_run_double_then_single_stream():
    names = [
        "x_embedder.weight",
        "single_transformer_blocks.0.proj_out.weight",
        "transformer_blocks.1.attn.to_q.weight",
        "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.10.attn.to_q.weight",
        "single_transformer_blocks.2.norm.linear.weight",
    ]
    blocks, nonblock = group_keys(names, BLOCK_FAMILIES["flux"])
    assert [(b.list_name, b.index) for b in blocks] == [
        ("transformer_blocks", 0), ("transformer_blocks", 1), ("transformer_blocks", 10),
        ("single_transformer_blocks", 0), ("single_transformer_blocks", 2),
    ]
    assert [b.order for b in blocks] == [0, 1, 2, 3, 4]
    assert nonblock == ["x_embedder.weight"]


def test_wan_prefix_is_not_confused_with_similar_names():
    blocks, nonblock = group_keys(["blocks.0.a", "blocks_extra.0.a", "blocks.1"], BLOCK_FAMILIES["wan"])
    assert [b.keys for b in blocks] == [("blocks.0.a",)]
    assert sorted(nonblock) == ["blocks.1", "blocks_extra.0.a"]


def test_unknown_class_names_known_ones():
    with pytest.raises(KeyError, match="WanTransformer3DModel"):
        family_of("UNet2DConditionModel")


def test_describe_reads_facts_without_torch(tmp_path):
    from dlo.engine.families.tiny import make_tiny_transformer

    make_tiny_transformer(tmp_path / "transformer", "wan", layers=3)
    (tmp_path / "model_index.json").write_text("{}")
    facts = describe(tmp_path)  # a pipeline folder resolves to its transformer/
    assert facts.family == "wan" and facts.blocks == 3
    assert 0 < facts.largest_block_bytes * 3 + facts.nonblock_bytes
    assert facts.bytes >= facts.nonblock_bytes + 3 * (facts.largest_block_bytes - 256 * 40)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_adapter_implements_the_whole_interface(name):
    from dlo.engine.families.pipelines import PipelineFamily
    from dlo.engine.presets import PRESETS

    fam = FAMILIES[name]
    assert fam.name == name and fam.pipeline_class and fam.blocks.block_lists
    for method in ("pipeline_facts", "call_kwargs", "decode"):
        assert getattr(type(fam), method) is not getattr(PipelineFamily, method), f"{name} lacks {method}"
    # the offload finds the transformer's block lists by its class, in the one registry
    assert BLOCK_FAMILIES[fam.blocks.name] is fam.blocks and family_of(fam.blocks.class_names[0]) is fam.blocks
    # every family has a tiny preset of `dlo make-random-model` (the CI pipelines)
    assert any(p.name.startswith("tiny-") and fam.matches(_index(p)) for p in PRESETS.values()), name


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_make_tiny_model_families_have_a_tiny_writer(name):
    from dlo.engine.families.tiny_writers import TINY_WRITERS, TinyWriter

    assert set(TINY_WRITERS) <= set(FAMILIES)  # keyed by pipeline families
    writer = TINY_WRITERS[name]
    for method in ("transformer_config", "write_components"):
        assert getattr(type(writer), method) is not getattr(TinyWriter, method), f"{name} lacks {method}"


def test_block_families_cover_streamed_text_encoders_without_a_pipeline():
    assert family_of("UMT5EncoderModel") is family_of("T5EncoderModel") is BLOCK_FAMILIES["t5-encoder"]
    assert family_of("Qwen2_5_VLForConditionalGeneration").block_lists == ("model.language_model.layers",)
    assert not {"t5-encoder", "qwen2.5-vl-encoder"} & set(FAMILIES)


def _index(p) -> dict:
    index = {"_class_name": p.pipeline_class, **{c.name: [c.library, c.class_name] for c in p.components}}
    return {**index, **p.index_extras}


def test_serving_pipeline_has_no_family_branch():
    from pathlib import Path

    import dlo.serving.pipeline as pipeline

    text = Path(pipeline.__file__).read_text()
    assert not any(f'"{name}"' in text for name in FAMILIES)
