"""Family registry and checkpoint key grouping."""

import pytest

from dlo.engine.families import FAMILIES, describe, family_of, group_keys


def test_flux_blocks_run_double_then_single_stream():
    names = [
        "x_embedder.weight",
        "single_transformer_blocks.0.proj_out.weight",
        "transformer_blocks.1.attn.to_q.weight",
        "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.10.attn.to_q.weight",
        "single_transformer_blocks.2.norm.linear.weight",
    ]
    blocks, nonblock = group_keys(names, FAMILIES["flux"])
    assert [(b.list_name, b.index) for b in blocks] == [
        ("transformer_blocks", 0), ("transformer_blocks", 1), ("transformer_blocks", 10),
        ("single_transformer_blocks", 0), ("single_transformer_blocks", 2),
    ]
    assert [b.order for b in blocks] == [0, 1, 2, 3, 4]
    assert nonblock == ["x_embedder.weight"]


def test_wan_prefix_is_not_confused_with_similar_names():
    blocks, nonblock = group_keys(["blocks.0.a", "blocks_extra.0.a", "blocks.1"], FAMILIES["wan"])
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
    from dlo.engine.families.base import Family
    from dlo.engine.presets import PRESETS

    fam = FAMILIES[name]
    assert fam.name == name and fam.block_lists and fam.pipeline_class
    for method in ("pipeline_facts", "call_kwargs", "decode"):
        assert getattr(type(fam), method) is not getattr(Family, method), f"{name} lacks {method}"
    if name in ("wan", "flux"):  # `dlo make-tiny-model --family` writes these
        for method in ("tiny_transformer_config", "write_tiny_components"):
            assert getattr(type(fam), method) is not getattr(Family, method), f"{name} lacks {method}"
    if fam.class_names:
        assert family_of(fam.class_names[0]) is fam
    else:  # a pipeline variant (I2V, two experts) of a transformer class another adapter names
        assert any(f.block_lists == fam.block_lists and f.class_names for f in FAMILIES.values())
    # every family has a tiny preset of `dlo make-random-model` (the CI pipelines)
    assert any(p.name.startswith("tiny-") and fam.matches(_index(p)) for p in PRESETS.values()), name


def _index(p) -> dict:
    index = {"_class_name": p.pipeline_class, **{c.name: [c.library, c.class_name] for c in p.components}}
    return {**index, **p.index_extras}


def test_serving_pipeline_has_no_family_branch():
    from pathlib import Path

    import dlo.engine.serving.pipeline as pipeline

    text = Path(pipeline.__file__).read_text()
    assert not any(f'"{name}"' in text for name in FAMILIES)
