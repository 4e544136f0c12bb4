"""The serving half of the family contract: what a request means for one diffusers pipeline.

Owns: `PipelineFamily` (a pipeline family's adapter: the diffusers pipeline class, the transformer's
`BlockFamily`, the text encoders that may stream, which folders it serves, their `PipelineFacts`,
the call plan a request implies, the pipeline call's keyword arguments and non-JSON inputs, and how
its output decodes into frames), `PipelineFacts` (what a request is validated against), `Decoded`
and `decode_in_own_dtype` (a built pipeline's VAE takes its latents in its own dtype).
The offload half (block lists) is `dlo.engine.families.base`.
Must never: import torch, diffusers, numpy or PIL at import time (adapters import them inside
methods), import `dlo.serving`, or know about HTTP, queues or ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.layout import align_up, latent_tokens
from dlo.engine.cache_presets import MAX_ORDER
from dlo.engine.request import Generation


# the warm-up's default steps (`--warmup-steps`): one. On the H200 a warm-up of one step left the
# first request within 1.6% of the second (two steps: within 10.6%), and starts 0-0.6 s sooner
# (record `ready-h200-2026-12-01-b`): a later step adds only elementwise kernels
WARMUP_STEPS = 1


def decode_in_own_dtype(vae: Any) -> None:
    """Cast the latents to the VAE's dtype on the way in: the VAE runs in float32 (its output becomes
    the bytes) while Flux and QwenImage hand it latents in the transformer's dtype (bfloat16)."""
    inner = vae.decode

    def decode(z: Any, *args: Any, **kwargs: Any) -> Any:
        return inner(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode  # type: ignore[method-assign]


@dataclass(frozen=True)
class PipelineFacts:
    """What a request may ask of this pipeline folder (torch-free)."""

    family: str  # a `FAMILIES` name: "wan", "wan2.2", "wan-i2v", "flux", "qwen-image", "cosmos3", "minimax-h3"
    pipeline_class: str
    size_multiple: int  # width and height must be multiples of this (VAE scale x patch)
    temporal_factor: int  # the VAE's temporal compression (Wan: frames 4k+1); 0: images only
    default_guidance: float
    transformer_class: str
    # the pipeline's transformer components, each streamed by its own `dlo.engine.load` (Wan2.2: two experts)
    transformers: tuple[str, ...] = ("transformer",)
    image_input: bool = False  # image-to-video: a request must bring an input image
    accepts_image: bool = False  # a video request may bring an input image (Cosmos3 i2v, MiniMax-H3 fl2va)
    # valid frame counts: frame_step * k + frame_offset, k >= 0 (frame_step 0: temporal_factor; Wan 4k+1,
    # MiniMax-H3 17k+5), within [min_frames, max_frames] (0: no bound of the model's own)
    frame_step: int = 0
    frame_offset: int = 1
    min_frames: int = 1
    max_frames: int = 0
    fps: int = 0  # the model's own frame rate (MiniMax-H3: 24, fixed); 0: the server's `video_fps`
    images: bool = True  # image requests (a 1-frame generation) are served
    max_n: int = 0  # largest n of an image request (Cosmos3: one sample per call); 0: the server's limit
    audio: bool = False  # its videos carry a generated sound track (muxed into the MP4)
    no_sp: str = ""  # why sequence parallelism (--sp > 1) is not served for it; "": it is
    # the smallest width and height it runs (0: size_multiple). Cosmos3: two latent pixels per side,
    # since at one its VAE's attention gets a query torch's fused kernels refuse ([Note: one latent pixel])
    min_side: int = 0
    # the fewest denoising steps it runs: MiniMax-H3's scheduler needs two (without explicit sigmas)
    min_steps: int = 1

    @property
    def smallest_side(self) -> int:
        """The smallest width and height served: `min_side` rounded up to a multiple of `size_multiple`."""
        return max(self.size_multiple, align_up(self.min_side, self.size_multiple))

    def call_tokens(self, gen: Generation) -> int:
        """Latent tokens of one transformer call of `gen` (every image of it, all its latent frames),
        the whole request's: what `--lora-apply auto` decides by, the same on every rank."""
        return latent_tokens(gen.width, gen.height, gen.frames, gen.n, self.size_multiple, self.temporal_factor)

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> "PipelineFacts":
        """`dlo.engine.families.pipeline_facts(model_dir)`."""
        from dlo.engine.families import pipeline_facts

        return pipeline_facts(model_dir)

    @property
    def supports_video(self) -> bool:
        return self.temporal_factor > 0

    @property
    def adapter(self) -> "PipelineFamily":
        from dlo.engine.families import FAMILIES

        return FAMILIES[self.family]

    def _step(self) -> int:
        return self.frame_step or self.temporal_factor

    def valid_frames(self, seconds: float, fps: int) -> int:
        """The family's frame count (Wan: 4k+1) nearest to seconds x fps, at least 1; whether the
        model makes that many is `frames_error`'s to say."""
        if not self.supports_video:
            raise ValueError(f"{self.pipeline_class} makes images only")
        t, off = self._step(), self.frame_offset
        k = max(0, math.floor((max(1.0, seconds * fps) - off) / t + 0.5))  # ties round up: never shorter
        return t * k + off

    def shortest_seconds(self, fps: int) -> float:
        """The shortest clip the model makes, in seconds at `fps`."""
        return self.min_frames / fps

    def frames_error(self, frames: int) -> str | None:
        """Why `frames` is no valid frame count of this model, or None when it is one."""
        t, off = self._step(), self.frame_offset
        form = f"{t}k+{off} ({', '.join(str(t * k + off) for k in range(3))}, ...)"
        if frames < off or (frames - off) % t:
            return f"num_frames must be {form}, got {frames}"
        if frames < self.min_frames or (self.max_frames and frames > self.max_frames):
            top = f" and {self.max_frames}" if self.max_frames else ""
            rate = (f"; {self.min_frames / self.fps:.2f} to {self.max_frames / self.fps:.2f} s at {self.fps} fps"
                    if self.fps and self.max_frames else "")
            return f"{self.pipeline_class} generates between {self.min_frames}{top} frames ({form}{rate}), got {frames}"
        return None

    def uses_cfg(self, gen: Generation) -> bool:
        """Whether the pipeline runs a separate unconditional transformer call per step."""
        return self.adapter.uses_cfg(gen)

    def transformer_calls(self, gen: Generation) -> int:
        """Transformer forwards one request makes: steps x CFG branches (separate calls)."""
        return self.adapter.transformer_calls(gen)

    def warmup_steps(self, model_dir: Path, steps: int) -> int:
        """The warm-up's steps for `--warmup-steps steps`: at least `min_steps`, and as many more as
        the family needs for every transformer of the pipeline to run (its adapter's `warmup_steps`)."""
        return self.adapter.warmup_steps(model_dir, max(steps, self.min_steps))

    def warmup(self, width: int, height: int, steps: int = WARMUP_STEPS) -> Generation:
        """The warm-up request at this size, `steps` steps (`warmup_steps` decides them): an image,
        or the shortest video of a family that makes videos only."""
        if self.images:
            return Generation(kind="image", prompt="warm-up", seed=0, width=width, height=height, steps=steps,
                              guidance_scale=self.default_guidance)
        fps = self.fps or 24
        return Generation(kind="video", prompt="warm-up", seed=0, width=width, height=height, steps=steps,
                          guidance_scale=self.default_guidance, frames=self.valid_frames(self.shortest_seconds(fps), fps),
                          fps=fps)


def reference_image(gen: Generation) -> dict[str, Any]:
    """The request's input image (`input_reference`) as the pipeline call's `image` (PIL, RGB); {} without one."""
    if gen.image is None:
        return {}
    import io

    from PIL import Image

    with Image.open(io.BytesIO(gen.image)) as img:
        return {"image": img.convert("RGB")}


@dataclass(frozen=True)
class Decoded:
    """A pipeline's output as float frames in [0, 1]: one video (frames, H, W, 3) or images (H, W, 3)."""

    images: tuple[Any, ...] = ()
    video: Any = None
    audio: Any = None  # the video's sound track: float samples in [-1, 1], (channels, samples)
    sample_rate: int = 0  # of `audio`


class PipelineFamily:
    """One pipeline family's adapter. Subclasses set the class attributes and implement
    `pipeline_facts`, `call_kwargs` and `decode`; the other methods have the common behaviour."""

    name: str = ""
    pipeline_class: str = ""  # diffusers pipeline class (model_index.json `_class_name`)
    blocks: BlockFamily  # the transformer's block lists (what `dlo.engine.load` streams)
    # Text encoders that may stream through the engine (`dlo serve --stream-text-encoders`), in the
    # order the pipeline calls them; each runs once for the prompt and once more for CFG's negative.
    streamable_encoders: tuple[str, ...] = ()
    # Keyword arguments of the common pipeline call (`ServingPipeline`) this pipeline does not take.
    unused_call_args: tuple[str, ...] = ()
    # The VAE decodes in tiles at every size (MiniMax-H3's was released so: untiled, its output
    # differs); else tiles only above `ServingPipeline.vae_tile_above_pixels`.
    vae_always_tiled: bool = False
    # `warm_decode` is the call's own decode: the warm-up runs it beside its denoising
    # ([Note: the warm-up's decode beside its denoising] in `dlo.serving.warm_run`)
    decode_beside_warmup: bool = False
    # The pipeline calls the transformer cond then uncond each step, with the same objects but for
    # the arguments that carry the negative prompt: `--cfg-pairs` may pair them ([Note: CFG pairs] in
    # `dlo.engine.cfg_pairs`; a family is marked once a test shows paired bytes equal unpaired ones)
    cfg_pairs: bool = False
    # A request may ask for a step cache (`dlo.engine.step_cache`): diffusers' cache hooks know the
    # transformer's blocks and the pipeline names each call's cache context (cond, uncond)
    step_caches: bool = False
    # its blocks return the text stream too (Flux, Qwen-Image): a step cache keeps its residuals as well
    two_streams: bool = False

    def __repr__(self) -> str:
        return f"PipelineFamily({self.name!r})"

    def matches(self, index: dict) -> bool:
        """Whether this adapter serves the pipeline folder whose model_index.json is `index`."""
        return index.get("_class_name") == self.pipeline_class

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        raise NotImplementedError

    def paired_lane_bytes(self, transformer: dict) -> tuple[int, int]:
        """What the waiting lane of CFG pairs holds between two blocks, in device bytes per latent
        token and per text token, from the transformer's config (`dlo.plan.memory_model` adds it to a
        paired call's peak). Only families marked `cfg_pairs` say; (0, 0) for the rest."""
        return (0, 0)

    def step_cache_bytes(self, transformer: dict) -> tuple[int, int]:
        """What the largest step cache's state holds while a request's transformer calls run, in device
        bytes per latent token and per text token, from the transformer's config (`dlo.plan.memory_model`
        adds it to a call's peak): First Block Cache keeps, per cache context (cond and uncond), its first
        block's output and residual and the last block's residual (each stream's, bfloat16), and makes a
        new residual before it drops the old one; TaylorSeer lite, the output projection's factors (up to
        order 4, float32) a context; MagCache (a residual and an input a context) keeps less. (0, 0) for
        a family that runs none."""
        if not self.step_caches:
            return (0, 0)
        dim = int(transformer["num_attention_heads"]) * int(transformer["attention_head_dim"])
        patch = transformer.get("patch_size") or 1
        out = int(transformer.get("out_channels") or transformer["in_channels"]) * math.prod(
            patch if isinstance(patch, (list, tuple)) else (patch, patch))
        first_block, taylor = (2 * 3 + 1) * dim * 2, 2 * (MAX_ORDER + 1) * out * 4
        return (max(first_block, taylor), 2 * 2 * dim * 2 if self.two_streams else 0)

    def build_pipeline(self, model_dir: Path, modules: dict[str, Any], compute_dtype: Any, device: Any, *,
                       safety_checker: bool = False) -> Any:
        """The diffusers pipeline of `model_dir` with the streamed `modules` in place of its own
        (the VAE stays float32: its output becomes the bytes); `safety_checker`: the pipeline's own,
        where it has one. Default: `from_pretrained`."""
        import diffusers
        import torch

        return getattr(diffusers, self.pipeline_class).from_pretrained(
            model_dir, **modules, dtype={"default": compute_dtype, "vae": torch.float32})

    def run(self, pipe: Any, kwargs: dict[str, Any], on_step: Any) -> Any:
        """Call the pipeline; `on_step(pipe, i, t, callback_kwargs)` after every denoising step."""
        return pipe(**kwargs, callback_on_step_end=on_step)

    def call_plan(self, gen: Generation, pipe: Any) -> list[tuple[str, int]]:
        """Transformer forwards one request makes, per transformer component, in the order they run
        (what an idle rank walks with `gather_only`; `pipe` is the loaded diffusers pipeline)."""
        return [("transformer", self.transformer_calls(gen))]

    def warmup_steps(self, model_dir: Path, steps: int) -> int:
        """The warm-up's steps for `--warmup-steps steps`: enough that every transformer of the
        pipeline runs (its first calls then come before `/ready`). Default: `steps`."""
        return steps

    def encoder_calls(self, gen: Generation) -> int:
        """Forwards of each streamable text encoder per request (prompt, plus the negative with CFG)."""
        return 2 if self.uses_cfg(gen) else 1

    def call_inputs(self, gen: Generation) -> dict[str, Any]:
        """Inputs of the pipeline call that are not plain JSON values (an input image); default none."""
        return {}

    def decode_tiled(self, gen: Generation, tile_above_pixels: int) -> bool:
        """Whether `gen`'s VAE decode is tiled: always for a family released so, else above the
        deployment's threshold of decoded pixels (the same rule on every rank and in every mode)."""
        return self.vae_always_tiled or gen.width * gen.height * max(1, gen.frames) * gen.n > tile_above_pixels

    def uses_cfg(self, gen: Generation) -> bool:
        """Whether a request runs a separate unconditional transformer call per step."""
        return gen.guidance_scale > 1.0

    def transformer_calls(self, gen: Generation) -> int:
        """Transformer forwards one request makes (what idle ranks pass to `gather_only`)."""
        return gen.steps * (2 if self.uses_cfg(gen) else 1)

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        """The family's own keyword arguments of the pipeline call (beyond prompt, size, steps, ...)."""
        raise NotImplementedError

    def decode(self, out: Any, gen: Generation) -> Decoded:
        """The pipeline call's output (`output_type="np"`) as frames."""
        raise NotImplementedError

    def warm_decode(self, pipe: Any, gen: Generation) -> Any:
        """The pipeline call's output (`output_type="np"`) for `gen` were its latents zero, made by
        the call's own decode steps (the VAE at the request's latent shape, its post-processing):
        where `decode_beside_warmup` is set."""
        raise NotImplementedError
