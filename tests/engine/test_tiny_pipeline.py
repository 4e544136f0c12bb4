"""`dlo make-tiny-model` writes whole pipelines that diffusers loads offline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engine.serving_helpers import offline_env

pytestmark = pytest.mark.slow  # subprocesses that import torch and diffusers


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_make_tiny_model_writes_a_pipeline_diffusers_loads_offline_and_runs(tmp_path, family):
    out = tmp_path / family
    res = subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(out), "--family", family],
                         capture_output=True, text=True, env=offline_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["bytes"] < 100 * 2**20
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == {"wan": "WanPipeline", "flux": "FluxPipeline"}[family]
    for name, value in index.items():
        if isinstance(value, list) and value[0] is not None:
            assert (out / name).is_dir(), f"{name} listed in model_index.json but not written"
    # Load it the way a user would (offline), the transformer through diffusers itself, and run it.
    code = f"""
import json, sys, torch, diffusers
from safetensors.torch import load_file
root = {str(out)!r}
cfg = json.load(open(root + '/transformer/config.json'))
tr = getattr(diffusers, cfg['_class_name']).from_config(cfg)
tr.load_state_dict(load_file(root + '/transformer/diffusion_pytorch_model.safetensors'))
pipe = getattr(diffusers, {index['_class_name']!r}).from_pretrained(root, transformer=tr)
kw = dict(num_frames=1) if {family!r} == 'wan' else {{}}
out = pipe(prompt='a cat', height=32, width=32, num_inference_steps=1, max_sequence_length=16,
           generator=torch.Generator().manual_seed(0), output_type='np', **kw)
arr = out.frames if hasattr(out, 'frames') else out.images
print(list(arr.shape), float(arr.std()))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=offline_env(), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    shape, std = run.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert json.loads(shape)[-3:] == [32, 32, 3]
    assert float(std) > 0.01, "the tiny pipeline produced a flat image: random weights did not take"
