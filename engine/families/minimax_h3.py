"""The MiniMax-H3 family (joint video + audio: `MiniMaxH3Transformer3DModel` + `MiniMaxH3ModularPipeline`).

Owns: MiniMax-H3's block lists (the 2 `token_refiner.refiner_blocks`, then the 50
`transformer_blocks`: the order one forward runs them), recognising its modular folder (only a
`modular_model_index.json`), its pipeline facts, building the pipeline and what a request means for
it, and how its output decodes (the video and its stereo sound track).

The pipeline is diffusers' modular one, driven whole: `ModularPipeline.from_pretrained(folder)`
reads the folder's index and the blocks (`MiniMaxH3Blocks`, which route a request with an `image`
to `fl2va` and one without to `t2va`: both use `transformer/`), then `update_components` hands it
every component, so it loads nothing itself: the streamed transformer and Qwen3-VL text encoder
from `dlo.engine.load`, the two VAEs through `load_whole` (diffusers would need accelerate for
their fp32-kept modules), the tokenizer, the two schedulers (video shift 12, audio shift 3) and
the Qwen3-VL processor (its image half only: the video half needs torchvision, which only
`ref2va`'s video references use). The blocks-level API is not needed: nothing is split between
text encoding and denoising. `ref2va` (`transformer_ref/`, reference images, video and audio) is
not served.

Requests: guidance-distilled (no CFG, no negative prompt, no guidance_scale): `num_inference_steps`
N is N points of the scheduler's schedule, N - 1 transformer forwards, one text-encoder forward.
Fixed 24 fps; 17k+5 frames between 5 and 15 s (124..345); sizes a multiple of VAE 16 x patch 2;
videos only (an image request is refused: the shortest video is 124 frames); an `input_reference`
image is the first keyframe (fl2va). Sound is always generated (stereo, the audio VAE's rate).
Sequence parallelism: the transformer has diffusers' `_cp_plan` (Ulysses), but it splits the one
packed sequence (text + keyframes + audio + video rows), whose length follows the prompt's token
count: it must divide by sp, which `dlo serve` cannot promise a request, so sp is refused.
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.families.pipelines import Decoded, PipelineFacts, PipelineFamily, reference_image
from dlo.engine.request import Generation

MINIMAX_H3_BLOCKS = BlockFamily("minimax-h3", ("MiniMaxH3Transformer3DModel",),
                                ("token_refiner.refiner_blocks", "transformer_blocks"))
FPS = 24  # MiniMax-H3's own rate (`MiniMaxH3ModularPipeline.fps`)
SECONDS = (5.0, 15.0)  # its min_duration / max_duration
MIN_STEPS = 2  # its scheduler's `set_timesteps` refuses fewer without an explicit sigmas schedule


NO_SP = ("its Ulysses _cp_plan splits one packed sequence (text, keyframe, audio and video rows) whose length "
         "follows the prompt's token count and must divide by sp; padding it would change the unmasked attention, "
         "and diffusers' ulysses_anything does not run on gloo")


class MiniMaxH3Family(PipelineFamily):
    name = "minimax-h3"
    blocks = MINIMAX_H3_BLOCKS
    pipeline_class = "MiniMaxH3ModularPipeline"
    streamable_encoders = ("text_encoder",)  # Qwen3-VL-32B's language model layers
    unused_call_args = ("negative_prompt", "guidance_scale", "max_sequence_length")
    vae_always_tiled = True  # `AutoencoderKLMiniMaxH3` tiles by default; disabling it changes the output

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        spatial = math.prod(vae.get("spatial_downsample_factors") or [2, 2, 2, 2, 1, 1])
        temporal = math.prod(vae.get("temporal_downsample_factors") or [1, 2, 2, 1, 1, 1])
        chunk = int(vae.get("clip_length") or 17)  # pixel frames per VAE chunk
        kept = math.ceil(chunk / temporal)  # latent frames a chunk keeps (`tokens_chunk_size`)
        lo = math.ceil((SECONDS[0] * FPS - kept) / chunk) * chunk + kept
        hi = math.floor((SECONDS[1] * FPS - kept) / chunk) * chunk + kept
        patch = transformer.get("patch_size", [1, 2, 2])
        return PipelineFacts(self.name, self.pipeline_class, spatial * int(patch[2]), temporal, 1.0,
                             transformer["_class_name"], accepts_image=True, frame_step=chunk, frame_offset=kept,
                             min_frames=lo, max_frames=hi, fps=FPS, images=False, audio=True, no_sp=NO_SP,
                             min_steps=MIN_STEPS)

    def build_pipeline(self, model_dir: Path, modules: dict[str, Any], compute_dtype: Any, device: Any, *,
                       safety_checker: bool = False) -> Any:  # MiniMax-H3 has no safety checker
        import diffusers
        import transformers

        from dlo.engine.families.whole import load_whole

        pipe = diffusers.ModularPipeline.from_pretrained(str(model_dir))
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        parts: dict[str, Any] = {
            "vae": load_whole(model_dir / "vae"), "audio_vae": load_whole(model_dir / "audio_vae"),
            "tokenizer": tokenizer, "processor": image_only_processor(model_dir / "processor", tokenizer),
            "scheduler": diffusers.MiniMaxH3Scheduler.from_pretrained(model_dir / "scheduler"),
            "audio_scheduler": diffusers.MiniMaxH3Scheduler.from_pretrained(model_dir / "audio_scheduler"),
        }
        if "text_encoder" not in modules:  # resident, or --no-stream-text-encoders: whole, by transformers
            parts["text_encoder"] = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
                model_dir / "text_encoder", dtype=compute_dtype).eval()
        pipe.update_components(**modules, **parts)
        _quiet(pipe._blocks)  # the blocks it runs (`pipe.blocks` is a copy)
        return pipe

    def uses_cfg(self, gen: Generation) -> bool:
        return False  # guidance-distilled

    def transformer_calls(self, gen: Generation) -> int:
        # `MiniMaxH3Scheduler.set_timesteps(N)`: N points of linspace(1, 0, N), N - 1 intervals
        return max(0, gen.steps - 1)

    def encoder_calls(self, gen: Generation) -> int:
        return 1  # the prompt only: no negative branch

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        return {"num_frames": gen.frames, "output": ["videos", "audio", "sampling_rate"]}

    def call_inputs(self, gen: Generation) -> dict[str, Any]:
        return reference_image(gen)

    def run(self, pipe: Any, kwargs: dict[str, Any], on_step: Any) -> Any:
        # The modular loop takes no step callback: the transformer's forwards are the steps. After
        # forward k the schedule has reached point k + 1 of N (the last forward ends the denoising).
        count = [0]

        def after_forward(_module: Any, _args: Any, _out: Any) -> None:
            count[0] += 1
            on_step(pipe, count[0], None, {})

        handle = pipe.transformer.register_forward_hook(after_forward)
        try:
            return pipe(**kwargs)
        finally:
            handle.remove()

    def decode(self, out: Any, gen: Generation) -> Decoded:
        import numpy as np

        video = np.asarray(out["videos"])[0]  # (frames, H, W, 3) in [0, 1]
        audio = out["audio"][0].float().cpu().numpy()  # (2, samples)
        return Decoded(video=video, audio=audio, sample_rate=int(out["sampling_rate"]))


def image_only_processor(folder: Path, tokenizer: Any) -> Any:
    """Qwen3-VL's processor over the folder's image processor, without its video processor (which
    needs torchvision; only ref2va's video references use it)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImageOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                                     tokenizer=tokenizer, video_processor=None)


def _quiet(blocks: Any) -> None:
    """No progress bars from the blocks (the denoise loop is nested below the top level, where
    `set_progress_bar_config` does not reach)."""
    for sub in getattr(blocks, "sub_blocks", {}).values():
        if hasattr(sub, "set_progress_bar_config"):
            sub.set_progress_bar_config(disable=True)
        _quiet(sub)
