"""The reference of the step-cache tests: plain diffusers with `enable_cache`, in its own process.

Run as `python -m tests.engine.cache_reference SPEC.json OUT_DIR` with accelerate on the path
(`tests/engine/lora_reference.py`'s `REFERENCE_DIR`: diffusers loads a model with float32-kept
modules only through it); SPEC: {"model_dir", "dtype", "max_sequence_length", "cases": [{"config":
{"class": a diffusers cache config class, "kwargs": {...}} | null, "gen": {Generation fields}}]}.
The configs are diffusers' own classes built from plain arguments here: nothing of DLO's presets
runs in this process. Writes OUT_DIR/case-<i>.npy (the pipeline's float output), case-<i>.out (the
PNG or MP4 a served request answers) and case-<i>.json ({"block_runs": the transformer blocks whose
forward ran, "block_calls": the blocks called}), which the tests compare with DLO's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str, out_dir: str) -> int:
    import diffusers
    import torch

    from dlo.engine.request import Generation
    from dlo.serving.pipeline import ServingPipeline
    from tests.engine.lora_reference import plain_pipeline, save_output

    spec = json.loads(Path(spec_path).read_text())
    pipe, facts, serving = plain_pipeline(spec)
    blocks = [b for name in facts.adapter.blocks.block_lists for b in pipe.transformer.get_submodule(name)]
    counts = {"block_runs": 0, "block_calls": 0}
    for b in blocks:
        # a block's first submodule runs only when the block's own forward does (not when a cache skips it)
        first = next(b.children())
        first.register_forward_pre_hook(lambda *_: counts.__setitem__("block_runs", counts["block_runs"] + 1))
        b.register_forward_pre_hook(lambda *_: counts.__setitem__("block_calls", counts["block_calls"] + 1))
    for i, case in enumerate(spec["cases"]):
        gen = Generation(**case["gen"])
        if case["config"] is not None:
            kwargs = dict(case["config"]["kwargs"])
            if "taylor_factors_dtype" in kwargs:
                kwargs["taylor_factors_dtype"] = getattr(torch, kwargs["taylor_factors_dtype"])
            pipe.transformer.enable_cache(getattr(diffusers, case["config"]["class"])(**kwargs))
        counts.update(block_runs=0, block_calls=0)
        with torch.inference_mode():
            out = pipe(**ServingPipeline.pipeline_kwargs(serving, gen))  # type: ignore[arg-type]
        if case["config"] is not None:
            pipe.transformer.disable_cache()
        save_output(out_dir, f"case-{i}", out, gen, facts)
        (Path(out_dir) / f"case-{i}.json").write_text(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
