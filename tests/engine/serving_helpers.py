"""Shared by the serving tests (not a test module): tiny pipelines made once per session."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory, family: str = "wan", dtype: str = "float32") -> Path:
    """A tiny random diffusers pipeline folder, written once per test session."""
    from dlo.engine.families.tiny import make_tiny_transformer, write_pipeline_components

    root = tmp_path_factory.getbasetemp() / f"tiny-{family}-{dtype}"
    if not (root / "model_index.json").exists():
        make_tiny_transformer(root / "transformer", family, dtype=dtype)
        write_pipeline_components(root, family=family, dtype=dtype)
    return root


def offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
