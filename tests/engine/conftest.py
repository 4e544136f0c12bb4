"""Fixtures shared by the engine's multi-process tests."""

from __future__ import annotations

import pytest

from dlo.engine.families.tiny import make_tiny_transformer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny transformers on disk, keyed (family, kind)."""
    root = tmp_path_factory.mktemp("models")
    return {
        # 3 blocks: an odd count, so a block alternates slots between calls
        ("wan", "bf16"): str(make_tiny_transformer(root / "wan", "wan", layers=3, dtype="bfloat16")),
        # 2 double-stream + 3 single-stream blocks of different sizes, float32
        ("flux", "fp32"): str(make_tiny_transformer(root / "flux", "flux", layers=2)),
        # several safetensors shards with an index file
        ("wan", "sharded"): str(
            make_tiny_transformer(root / "wan_sharded", "wan", layers=4, max_shard_size="40KB")
        ),
    }


# the LoRA tests' pipelines, adapters and diffusers + peft reference, made once per session
from tests.engine.lora_helpers import lora_setups  # noqa: E402,F401
