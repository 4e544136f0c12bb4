"""The reference of the `dlo fuse-lora` tests: plain diffusers with `load_lora_weights` and
`fuse_lora(lora_scale=scale)` (peft's merge), in its own process with peft on its path only
(`tests/engine/lora_reference.py` says why; pins: `tests/engine/lora-reference.txt`).

Run as `python -m tests.engine.fuse_reference SPEC.json` (one import of diffusers for every case);
SPEC: a list of {"model_dir", "dtype", "adapter", "scale", "out"}; writes each case's `out`, a
safetensors file of the pipeline's transformer state dict with the adapter fused, then unloaded
(the state dict diffusers' `save_pretrained` would write).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str) -> int:
    import diffusers
    import peft  # noqa: F401  (load_lora_weights needs it; an ImportError here names the missing install)
    import torch
    from safetensors.torch import save_file

    from dlo.engine.families import pipeline_facts

    torch.set_num_threads(1)
    for case in json.loads(Path(spec_path).read_text()):
        facts = pipeline_facts(case["model_dir"])
        pipe = getattr(diffusers, facts.pipeline_class).from_pretrained(
            case["model_dir"], torch_dtype={"default": getattr(torch, case["dtype"]), "vae": torch.float32})
        pipe.load_lora_weights(case["adapter"], adapter_name="fused")
        pipe.fuse_lora(components=["transformer"], lora_scale=case["scale"], adapter_names=["fused"])
        pipe.unload_lora_weights()  # the fused weights stay; the adapter's layers go
        save_file({k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}, case["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
