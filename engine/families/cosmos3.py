"""The Cosmos3 family (NVIDIA Cosmos3-Nano / -Super: `Cosmos3OmniTransformer` + `Cosmos3OmniPipeline`).

Owns: Cosmos3's block list and where its other weights live, its pipeline facts, what a request
means for `Cosmos3OmniPipeline` and how its output decodes (video frames, and the sound track where
the folder can make one).

Where the transformer's weights live (it carries its own Qwen3-VL text model; there is no text
encoder component):
- `layers` (36 in Nano, 64 in Super; both pathways of a layer, understanding and generation, are
  one block: one forward computes both) stream through the engine;
- `embed_tokens` (vocabulary 151,936: 1.24 GB in Nano, 1.56 GB in Super) stays in the host page
  cache and is looked up there; only the prompt's rows reach the device (`host_lookups`);
- `lm_head` (as large) is never called by the forward: it stays in the host page cache, never
  copied to the device (`unused`);
- the rest (norms, patch and time embeddings, sound and action heads: ~0.1 GB) is resident.
The VAE (`AutoencoderKLWan`, Wan2.2's 48-channel one) and the sound tokenizer load whole.

Requests: text-to-video, image-to-video when the request brings an `input_reference` (the
pipeline's `image`, anchored at latent frame 0), text-to-image for 1-frame requests (n = 1: the
pipeline makes one sample per call). Classifier-free guidance whenever guidance != 1 (a separate
unconditional forward per step, also without a negative prompt: the pipeline then uses ""). Videos
run at the transformer's `base_fps` (24), the rate the pipeline defaults to. Sound is generated and
muxed into the MP4 when the folder has a `sound_tokenizer` and the transformer `sound_gen`.
The safety checker (NVIDIA's `cosmos_guardrail`, whose package and models cannot be downloaded
here) is off by default: the pipeline is built with `enable_safety_checker=False` and called with
`enable_safety_check=False`; `dlo serve --safety-checker` (`EngineSettings.safety_checker`) builds it
with the checker and calls it with the check on (docs/serving.md).
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.families.pipelines import Decoded, PipelineFacts, PipelineFamily, reference_image
from dlo.engine.request import Generation

COSMOS3_BLOCKS = BlockFamily("cosmos3", ("Cosmos3OmniTransformer",), ("layers",), unused=("lm_head",),
                             host_lookups=("embed_tokens",))


NO_SP = ("Cosmos3OmniTransformer has no _cp_plan: its context parallelism is an external seam (_cp_shard_fn, "
         "_cp_gather_fn and a GQA-aware Ulysses processor, diffusers' examples/cosmos3) that DLO does not provide")


class Cosmos3Family(PipelineFamily):
    name = "cosmos3"
    blocks = COSMOS3_BLOCKS
    pipeline_class = "Cosmos3OmniPipeline"
    unused_call_args = ("max_sequence_length",)  # the prompt's length is the pipeline's own

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        sound = (index.get("sound_tokenizer") or [None])[0] is not None and bool(transformer.get("sound_gen"))
        # The pipeline checks sizes against the VAE's spatial factor; the transformer pads odd latent
        # sizes to its 2x2 patch itself. [Note: one latent pixel]
        spatial = int(vae.get("scale_factor_spatial") or 16)
        return PipelineFacts(self.name, self.pipeline_class, spatial,
                             int(vae.get("scale_factor_temporal") or 4), 6.0, transformer["_class_name"],
                             accepts_image=True, fps=int(transformer.get("base_fps") or 24), max_n=1, audio=sound,
                             no_sp=NO_SP, min_side=2 * spatial)

    def build_pipeline(self, model_dir: Path, modules: dict[str, Any], compute_dtype: Any, device: Any, *,
                       safety_checker: bool = False) -> Any:
        import diffusers
        import torch

        from dlo.engine.families.whole import load_whole

        # The VAE and the sound tokenizer load whole, float32 as stored (their outputs become the bytes),
        # built on meta and assigned their weights: without accelerate diffusers would first build them
        # with random weights.
        whole = {name: load_whole(model_dir / name) for name in ("vae", "sound_tokenizer")
                 if (model_dir / name / "config.json").is_file()}
        pipe = diffusers.Cosmos3OmniPipeline.from_pretrained(
            model_dir, **modules, **whole, enable_safety_checker=safety_checker, dtype=compute_dtype)
        # The pipeline takes its device from the transformer's first parameter, `embed_tokens`, which
        # stays on the host (a host lookup): the rank's device is where it runs.
        pipe._get_execution_device = lambda: torch.device(device)
        return pipe

    def uses_cfg(self, gen: Generation) -> bool:
        return gen.guidance_scale != 1.0  # the pipeline's own test: 0 < guidance < 1 also runs the uncond branch

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        return {"num_frames": gen.frames if gen.kind == "video" else 1, "fps": float(gen.fps or 24),
                "enable_sound": gen.kind == "video"}

    def call_inputs(self, gen: Generation) -> dict[str, Any]:
        return reference_image(gen)

    def run(self, pipe: Any, kwargs: dict[str, Any], on_step: Any) -> Any:
        sound = pipe.sound_tokenizer is not None and bool(getattr(pipe.transformer.config, "sound_gen", False))
        # the guardrail runs when the pipeline was built with it (`dlo serve --safety-checker`)
        kwargs = {**kwargs, "enable_sound": bool(kwargs.get("enable_sound")) and sound,
                  "enable_safety_check": pipe.safety_checker is not None}
        out = pipe(**kwargs, callback_on_step_end=on_step)
        rate = int(pipe.sound_tokenizer.config.sampling_rate) if kwargs["enable_sound"] else 0
        return out, rate

    def decode(self, out: Any, gen: Generation) -> Decoded:
        import numpy as np

        result, rate = out if isinstance(out, tuple) else (out, 0)
        video = np.asarray(result.video)  # (frames, H, W, 3): one sample, no batch axis
        if gen.kind != "video":
            return Decoded(images=(video[0],))
        audio = None
        if result.sound is not None and rate:
            audio = result.sound.float().cpu().numpy()  # (channels, samples)
        return Decoded(video=video, audio=audio, sample_rate=rate if audio is not None else 0)


# [Note: one latent pixel]
# At a side of one VAE factor (16x16 px) the Wan VAE's mid-block attention sees one latent pixel: its
# `qkv.permute(...).contiguous()` is then a no-op (a size-1 dimension's stride does not count), the
# query's sequence stride stays 1, and on cuda `scaled_dot_product_attention`'s fused kernels refuse
# it ("query is not correctly aligned (strideM)"; measured on the H200 in the encode of the
# pipeline's conditioning video). Two latent pixels per side make the copy real; the API refuses
# smaller sizes with a 400 naming the size, and the warm-up's smallest size is 32x32.
