"""`dlo make-random-model`: the published configs build their real classes (field names checked on
the meta device), real sizes, `--layers`, the disk-space refusal, generated tokenizers, and a tiny
preset written to disk and read back by the engine's checkpoint parser and by diffusers."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from dlo.engine.presets import PRESETS, preset

FULL = [n for n in PRESETS if not n.startswith("tiny-")]
TINY = [n for n in PRESETS if n.startswith("tiny-")]

# Published parameter counts (model cards / config sizes), billions: the transformer(s) and text encoder.
PARAMS_B = {
    ("wan2.1-t2v-14b", "transformer"): 14.29, ("wan2.1-t2v-14b", "text_encoder"): 5.68,
    ("wan2.1-i2v-14b", "transformer"): 16.4, ("wan2.2-t2v-a14b", "transformer_2"): 14.29,
    ("flux.1-dev", "transformer"): 11.9, ("flux.1-dev", "text_encoder_2"): 4.76,
    ("qwen-image", "transformer"): 20.4, ("qwen-image", "text_encoder"): 8.29,
    # Cosmos3: the transformers (the published 17 B / 64 B are whole repositories: presets_omni.py);
    # MiniMax-H3 and its Qwen3-VL-32B text encoder: 33 B each on their model cards
    ("cosmos3-nano", "transformer"): 15.17, ("cosmos3-super", "transformer"): 64.0,
    ("minimax-h3", "transformer"): 33.0, ("minimax-h3", "text_encoder"): 33.0,
}


def _known_fields(c) -> set[str]:
    import diffusers
    import transformers

    if c.library == "diffusers":
        return set(inspect.signature(getattr(diffusers, c.class_name).__init__).parameters)
    cls = getattr(transformers, c.class_name).config_class
    d = cls().to_dict()
    known = set(d) | set(getattr(cls, "attribute_map", {}))
    for sub in ("text_config", "vision_config"):
        if isinstance(d.get(sub), dict):
            known |= set(d[sub])
    return known | {"rope_theta", "rope_scaling"}  # hub spellings read into rope_parameters


@pytest.mark.parametrize("name", FULL + TINY)
def test_every_config_field_is_known_to_its_class_and_builds_on_meta(name):
    from dlo.engine.random_model import build_on_meta

    p = preset(name, layers=1 if name in FULL else None)  # one block: the fields, not the size, are checked
    for c in p.components:
        unknown = set(c.config) - _known_fields(c)
        assert not unknown, f"{name}/{c.name}: {c.class_name} does not know {sorted(unknown)}"
        module = build_on_meta(c)
        assert type(module).__name__ == c.class_name


def test_full_sizes_match_the_published_parameter_counts():
    from dlo.engine.random_model import build_on_meta

    for (name, comp), billions in PARAMS_B.items():
        module = build_on_meta(preset(name).component(comp))
        seen, n = set(), 0
        for t in module.state_dict(keep_vars=True).values():
            if id(t) not in seen:
                seen.add(id(t))
                n += t.numel()
        assert abs(n / 1e9 - billions) / billions < 0.04, f"{name}/{comp}: {n / 1e9:.2f}B parameters, published {billions}B"


def test_layers_caps_transformers_and_the_large_text_encoder_only():
    p = preset("flux.1-dev", layers=2)
    assert (p.component("transformer").config["num_layers"], p.component("transformer").config["num_single_layers"]) == (2, 4)
    assert p.component("text_encoder_2").config["num_layers"] == 2
    assert p.component("text_encoder").config["num_hidden_layers"] == 12  # CLIP stays whole
    w = preset("wan2.2-t2v-a14b", layers=3)
    assert [w.component(n).config["num_layers"] for n in ("transformer", "transformer_2", "text_encoder")] == [3, 3, 3]
    assert w.component("transformer").config["ffn_dim"] == 13824  # every other dimension stays real
    q = preset("qwen-image", layers=2)
    assert q.component("text_encoder").config["num_hidden_layers"] == 2
    assert q.component("text_encoder").config["vision_config"]["depth"] == 32
    with pytest.raises(ValueError):
        preset("qwen-image", layers=0)
    # MiniMax-H3 reads hidden state 50 of its Qwen3-VL: the encoder keeps 51 layers whatever --layers says
    h3 = preset("minimax-h3", layers=3)
    assert h3.component("transformer").config["num_layers"] == 3
    assert h3.component("text_encoder").config["text_config"]["num_hidden_layers"] == 51
    assert preset("minimax-h3").component("text_encoder").config["text_config"]["num_hidden_layers"] == 64
    assert preset("cosmos3-super", layers=5).component("transformer").config["num_hidden_layers"] == 5


def test_generated_tokenizers_have_the_real_id_range_specials_and_length():
    from dlo.engine.presets import CLIP_TOKENIZER, QWEN_TOKENIZER, UMT5_TOKENIZER
    from dlo.engine.random_model import make_tokenizer

    umt5 = make_tokenizer(UMT5_TOKENIZER)
    assert len(umt5) == 256384
    ids = umt5("a lighthouse at dusk", padding="max_length", max_length=512, truncation=True).input_ids
    assert len(ids) == 512 and ids[ids.index(1) + 1:] == [0] * (511 - ids.index(1)) and max(ids) < 256384
    clip = make_tokenizer(CLIP_TOKENIZER)
    ids = clip("a cat", padding="max_length", max_length=77).input_ids
    assert ids[0] == 49406 and ids[6] == 49407 and len(ids) == 77 and len(clip) == 49408
    qwen = make_tokenizer(QWEN_TOKENIZER)
    ids = qwen("<|im_start|>user\na cat<|im_end|>").input_ids
    assert ids[0] == 151644 and ids[-1] == 151645 and len(qwen) == 152064


def test_refuses_when_the_disk_lacks_room_and_writes_nothing(tmp_path):
    from dlo.engine.random_model import write_pipeline

    with pytest.raises(OSError, match="not enough disk space"):
        write_pipeline(tmp_path / "m", preset("wan2.1-t2v-14b", layers=1), free_bytes=2 * 2**30)
    assert not any((tmp_path / "m").iterdir())


def test_cli_writes_a_tiny_preset_the_engine_and_diffusers_read(tmp_path):
    import diffusers
    import torch

    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.blocks import describe

    out = tmp_path / "wan22"
    r = subprocess.run([sys.executable, "-m", "cli.main", "make-random-model", str(out), "--preset",
                        "tiny-wan2.2-t2v-a14b", "--no-progress", "--seed", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert "GiB to write" in r.stderr and set(summary["components"]) == {"transformer", "transformer_2",
                                                                         "text_encoder", "vae"}
    index = json.loads((out / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    for comp in ("transformer", "transformer_2", "text_encoder", "vae"):
        assert Checkpoint(out / comp).nbytes == summary["components"][comp]
    assert describe(out / "transformer_2").blocks == 2
    vae = diffusers.AutoencoderKLWan.from_pretrained(out / "vae")
    assert all(torch.isfinite(p).all() for p in vae.parameters())


def test_sharded_like_the_published_files(tmp_path):
    import torch

    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.random_model import write_safetensors

    specs = [(f"blocks.{i}.w", torch.bfloat16, (64, 64)) for i in range(5)] + [("norm.scale", torch.float32, (64,))]
    fill = lambda name, shape, dtype: [torch.zeros(shape, dtype=dtype)]  # noqa: E731
    info = write_safetensors(tmp_path, specs, stem="diffusion_pytorch_model", fill=fill, max_shard_bytes=2 * 64 * 64 * 2)
    assert info["files"] == 3
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert index["weight_map"]["blocks.0.w"] == "diffusion_pytorch_model-00001-of-00003.safetensors"
    assert set(Checkpoint(tmp_path).tensors) == {s[0] for s in specs}
