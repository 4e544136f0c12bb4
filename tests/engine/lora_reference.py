"""The reference of the LoRA tests: plain diffusers with `load_lora_weights` (peft), in its own process.

peft is a test-only dependency kept off the serving path: `make install` puts it in
`.venv/lora-reference` (pins: `tests/engine/lora-reference.txt`), and only this script's process
sees it (diffusers imports peft by itself wherever it is installed). Run as
`python -m tests.engine.lora_reference SPEC.json OUT_DIR [SPEC.json OUT_DIR ...]` (one process, one
import of diffusers, for every pipeline of a test session); SPEC: {"model_dir", "dtype", "adapters":
{name: path}, "cases": [{"adapter": name|null, "scale": float, "gen": {Generation fields}}]}; writes
OUT_DIR/case-<i>.npy (the pipeline's float output, `output_type="np"`) and case-<i>.out (the bytes a
served request answers: its PNG or MP4), which the tests compare with DLO's for the same request;
and for each case with an adapter the same with the adapter fused (`fuse_lora(lora_scale=scale)`,
peft's merge, what `dlo serve --lora-apply merge` equals): case-<i>-merged.{npy,out}.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path

REFERENCE_DIR = Path(sys.prefix) / "lora-reference"  # `make install`
SCALE_KWARG = {"wan": "attention_kwargs", "flux": "joint_attention_kwargs", "qwen-image": "attention_kwargs"}


def main(*args: str) -> int:
    import peft  # noqa: F401  (load_lora_weights needs it; an ImportError here names the missing install)

    for spec_path, out_dir in zip(args[::2], args[1::2]):
        run(spec_path, out_dir)
    return 0


def plain_pipeline(spec: dict) -> tuple:
    """Plain diffusers' pipeline of `spec["model_dir"]` in `spec["dtype"]` (the VAE float32, decoding in
    its own dtype as `ServingPipeline` runs it), the folder's facts, and what
    `ServingPipeline.pipeline_kwargs` reads to build a served request's call on it."""
    import diffusers
    import torch

    from dlo.engine.families import pipeline_facts
    from dlo.engine.families.pipelines import decode_in_own_dtype

    torch.set_num_threads(1)
    facts = pipeline_facts(spec["model_dir"])
    pipe = getattr(diffusers, facts.pipeline_class).from_pretrained(
        spec["model_dir"], torch_dtype={"default": getattr(torch, spec["dtype"]), "vae": torch.float32})
    pipe.set_progress_bar_config(disable=True)
    decode_in_own_dtype(pipe.vae)
    serving = types.SimpleNamespace(adapter=facts.adapter, max_sequence_length=spec.get("max_sequence_length", 16))
    return pipe, facts, serving


def save_output(out_dir: str, name: str, out, gen, facts) -> None:
    """A pipeline output as OUT_DIR/NAME.npy (its float frames) and NAME.out (the PNG or MP4 served)."""
    import numpy as np

    from dlo.serving.encode import encode

    frames = out.frames if hasattr(out, "frames") else out.images
    np.save(Path(out_dir) / f"{name}.npy", np.asarray(frames))
    (Path(out_dir) / f"{name}.out").write_bytes(encode(facts.adapter.decode(out, gen), gen.fps)[0][0])


def run(spec_path: str, out_dir: str) -> None:
    import torch

    from dlo.engine.request import Generation
    from dlo.serving.pipeline import ServingPipeline

    spec = json.loads(Path(spec_path).read_text())
    pipe, facts, serving = plain_pipeline(spec)
    for name, path in spec["adapters"].items():
        pipe.load_lora_weights(path, adapter_name=name)
    # the same pipeline call as a served request (`ServingPipeline.pipeline_kwargs`, on plain diffusers)
    def save(name: str, out, gen) -> None:
        save_output(out_dir, name, out, gen, facts)

    for i, case in enumerate(spec["cases"]):
        if case["adapter"] is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters([case["adapter"]])
        gen = Generation(**case["gen"])
        kwargs = ServingPipeline.pipeline_kwargs(serving, gen)  # type: ignore[arg-type]
        kwargs[SCALE_KWARG[facts.family]] = {"scale": case["scale"]}
        with torch.inference_mode():
            out = pipe(**kwargs)
        save(f"case-{i}", out, gen)
        if case["adapter"] is not None:
            kwargs = ServingPipeline.pipeline_kwargs(serving, gen)  # type: ignore[arg-type]  (a fresh generator)
            with fused(pipe, case["adapter"], case["scale"]), torch.inference_mode():
                save(f"case-{i}-merged", pipe(**kwargs), gen)  # a fused layer runs its base only: no scale kwarg


@contextlib.contextmanager
def fused(pipe, adapter: str, scale: float):
    """The pipeline with `adapter` fused into the transformer at `scale`, then exactly as before: the
    weights and peft's scalings restored from copies (`unfuse_lora` subtracts the delta, which does
    not round back to the same bits, and `lora_scale` rescales the layers for good)."""
    import torch

    model = pipe.transformer
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    scalings = [(m, dict(m.scaling)) for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)]
    pipe.enable_lora()
    pipe.set_adapters([adapter])
    pipe.fuse_lora(components=["transformer"], lora_scale=scale, adapter_names=[adapter])
    try:
        yield
    finally:
        pipe.unfuse_lora(components=["transformer"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in weights:
                    p.copy_(weights[n])
        for m, kept in scalings:
            m.scaling.clear()
            m.scaling.update(kept)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
