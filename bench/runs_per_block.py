"""Host->slot copies per block for a Wan2.1-14B-shaped checkpoint written the way safetensors
orders a file (dtype size descending, then name), per shard-group size. Decides whether
`dlo warm --repack` is worth having: no weights are generated (the file is sparse).

    python bench/runs_per_block.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wan_bench as wb  # noqa: E402


def main() -> None:
    wb.ensure_dlo_importable()
    import diffusers
    import torch

    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.dtypes import safetensors_name
    from dlo.engine.blocks import block_layout, group_keys
    from dlo.engine.families import BLOCK_FAMILIES
    from dlo.engine.meta import parameters_on_meta
    from dlo.engine.weights import page_cache_runs

    config = {**wb.WAN14B, "num_layers": 40}
    with parameters_on_meta():
        model = diffusers.WanTransformer3DModel.from_config(config)
    keep = set(diffusers.WanTransformer3DModel._keep_in_fp32_modules)
    specs = []
    for name, t in model.state_dict(keep_vars=True).items():
        dtype = torch.float32 if keep.intersection(name.split(".")) else torch.bfloat16
        specs.append((-dtype.itemsize, name, dtype, tuple(t.shape)))
    specs.sort()
    header, off = {}, 0
    for _, name, dtype, shape in specs:
        n = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": safetensors_name(dtype), "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "model.safetensors"
        with open(f, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little") + raw)
            fh.truncate(8 + len(raw) + off)  # sparse: no data written
        ck = Checkpoint(f)
        blocks, _ = group_keys(set(ck.tensors), BLOCK_FAMILIES["wan"])
        result = {}
        for g in (1, 2, 4, 8):
            counts = []
            for b in blocks:
                lay = block_layout(ck, b)
                counts.append(max(len(page_cache_runs(ck, lay, g, r)) for r in range(g)))
            result[g] = {"max_runs": max(counts), "tensors_per_block": len(blocks[0].keys)}
        print(json.dumps(result))


if __name__ == "__main__":
    main()
