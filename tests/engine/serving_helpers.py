"""Shared by the serving tests (not a test module): tiny pipelines made once per session."""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

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


def wait_until(cond: Callable[[], object], seconds: float, what: str, poll_s: float = 0.05) -> float:
    """Poll `cond` until it is true; fail naming `what` after `seconds`. Returns the seconds waited."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < seconds, f"timed out waiting until {what}"
        time.sleep(poll_s)
    return time.monotonic() - t0


def submit_in_order(url: str, fns: list[Callable[[], Any]], seconds: float = 60) -> list[Any]:
    """Run `fns` concurrently, each one sent only once the server holds every earlier one (queued,
    running, or already answered): arrival order = rank order inside a wave, by state, not by a sleep."""
    import requests

    def held(futures: list) -> bool:
        health = requests.get(url + "/health", timeout=5).json()
        return health.get("queued", 0) + health.get("running", 0) + sum(f.done() for f in futures) >= len(futures)

    with ThreadPoolExecutor(len(fns)) as pool:
        futures: list = []
        for fn in fns:
            futures.append(pool.submit(fn))
            wait_until(lambda: held(futures), seconds, f"the server holds request {len(futures)}")
        return [f.result() for f in futures]
