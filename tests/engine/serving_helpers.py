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


def plan_mode(mode, model_dir, dp=1, device="cpu", profile_path=None, sp=1, stream_dtype="bfloat16"):
    """(mode, reason) of `dlo serve`'s deployment plan for a folder, as its `_plan` step asks it."""
    from dlo.plan.deployment import PlanAsk, plan_folder
    from dlo.plan.limits import SMALL
    from dlo.plan.profile import profile_from_file
    from dlo.serving.host import local_profile

    host = local_profile(device)
    profile = profile_from_file(host, profile_path) if profile_path is not None else host
    ask = PlanAsk(dp=dp, sp=sp, mode=mode, device=device, stream_dtype=stream_dtype)
    p = plan_folder(model_dir, ask, profile=profile, limits=SMALL, device_memory=host.accelerator.memory_bytes)
    return p.mode, p.mode_reason


def serve_settings(argv: list[str], mode: str | None = None, device: str = "cpu", dp: int = 1,
                   env: dict | None = None):
    """`dlo serve`'s engine settings for `argv` (after MODEL) under a plan on `device` with `dp`
    ranks (`mode`: as `--mode`, else the flags'), for a transformer of no particular size."""
    import argparse
    import dataclasses

    from dlo.plan.deployment import plan
    from dlo.plan.facts import ModelFacts
    from dlo.plan.profile import NodeProfile
    from dlo.serving.config import engine_settings
    from dlo.serving.options import add_arguments, serve_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = serve_config(parser.parse_args(["/m", *argv]))
    ask = cfg.plan_ask(device, dp)
    if mode is not None:
        ask = dataclasses.replace(ask, mode=mode)
    p = plan(ask, profile=NodeProfile(), transformer=ModelFacts(bytes=10**9, largest_block_bytes=10**7, blocks=40),
             device_memory=10**11)
    return engine_settings(cfg, p, env or {})


def secret_volume(folder: Path, files: dict[str, bytes], mode: int = 0o644) -> Path:
    """`folder` laid out as the kubelet writes a Secret volume: the files in `..<timestamp>/`, `..data`
    a link to it, and each key a link `name -> ..data/name` (what `dlo serve --api-keys` reads)."""
    stamp = folder / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.time_ns() % 10**9:09d}"
    stamp.mkdir(parents=True)
    for name, data in files.items():
        (stamp / name).write_bytes(data)
        os.chmod(stamp / name, mode)
    os.symlink(stamp.name, folder / "..data")
    for name in files:
        os.symlink(f"..data/{name}", folder / name)
    return folder
