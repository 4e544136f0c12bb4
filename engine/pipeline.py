"""Diffusers pipelines on the DLO engine: one family adapter per pipeline class.

Owns: the facts the HTTP layer validates against (`PipelineFacts`, read from the folder's configs
without torch), the transformer-call count a request implies (what idle ranks pass to
`gather_only`), and `ServingPipeline`, which builds the pipeline with the transformer from
`dlo.engine.load` in place of diffusers' own and runs one request through the pipeline's
single-request path, returning encoded PNG or MP4 bytes.
Must never: batch requests of different ranks together, or touch the collective schedule except
through `dlo.engine.load`'s module and `gather_only` (every rank of a wave must issue the same
gathers in the same order).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dlo.engine.waves import Generation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineFacts:
    """What a request may ask of this pipeline folder (torch-free)."""

    family: str  # "wan" | "flux"
    pipeline_class: str
    size_multiple: int  # width and height must be multiples of this (VAE scale x patch)
    temporal_factor: int  # video frames must be temporal_factor * k + 1; 0: images only
    default_guidance: float
    transformer_class: str

    @property
    def supports_video(self) -> bool:
        return self.temporal_factor > 0

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> "PipelineFacts":
        root = Path(model_dir)
        try:
            index = json.loads((root / "model_index.json").read_text())
            transformer = json.loads((root / "transformer" / "config.json").read_text())
            vae = json.loads((root / "vae" / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{root} is not a diffusers pipeline folder (model_index.json, transformer/ and vae/ "
                f"with config.json): {e}"
            ) from e
        name = index.get("_class_name")
        if name == "WanPipeline":
            if (index.get("transformer_2") or [None])[0] is not None:
                raise ValueError(f"{root}: two-transformer Wan 2.2 pipelines are not supported yet")
            spatial = int(vae.get("scale_factor_spatial") or 8)
            patch = transformer.get("patch_size", [1, 2, 2])
            return cls("wan", name, spatial * int(patch[1]), int(vae.get("scale_factor_temporal") or 4), 5.0,
                       transformer["_class_name"])
        if name == "FluxPipeline":
            scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
            # latents are packed 2x2 before the transformer's own patch embedding
            return cls("flux", name, scale * 2, 0, 3.5, transformer["_class_name"])
        raise ValueError(f"{root}: pipeline class {name!r} is not supported; supported: WanPipeline, FluxPipeline")

    def valid_frames(self, seconds: float, fps: int) -> int:
        """The family's valid frame count nearest to seconds x fps (Wan: 4k+1), at least 1."""
        if not self.supports_video:
            raise ValueError(f"{self.pipeline_class} makes images only")
        t = self.temporal_factor
        want = max(1.0, seconds * fps)
        k = max(0, math.floor((want - 1) / t + 0.5))  # ties round up: never shorter than asked
        return t * k + 1

    def uses_cfg(self, gen: Generation) -> bool:
        """Whether the pipeline runs a separate unconditional transformer call per step."""
        if self.family == "wan":
            return gen.guidance_scale > 1.0
        return gen.negative_prompt is not None and gen.guidance_scale > 1.0  # Flux true CFG

    def transformer_calls(self, gen: Generation) -> int:
        """Transformer forwards one request makes: steps x CFG branches (separate calls)."""
        return gen.steps * (2 if self.uses_cfg(gen) else 1)


@dataclass
class RunResult:
    outputs: list[bytes]  # PNG per image, or one MP4
    media_type: str  # "image/png" | "video/mp4"
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _to_uint8(x: Any) -> Any:
    import numpy as np

    return (np.clip(np.asarray(x, dtype=np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)


def encode_png(frame: Any) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_to_uint8(frame)).save(buf, format="PNG")
    return buf.getvalue()


def encode_mp4(frames: Any, fps: int) -> bytes:
    """H.264 MP4 through imageio-ffmpeg; one encoder thread so the bytes never depend on the host."""
    import imageio_ffmpeg
    import numpy as np

    arr = _to_uint8(frames)
    h, w = arr.shape[1:3]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path, (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1,
            ffmpeg_log_level="error", output_params=["-threads", "1", "-bitexact"],
        )
        writer.send(None)
        for frame in arr:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


class ServingPipeline:
    """A diffusers pipeline whose transformer runs through DLO, run one request at a time.

    `tick` (settable) is called before every transformer block and at every phase boundary: the
    rank's progress signal for the wave watchdog.
    """

    def __init__(self, model_dir: Path | str, *, mode: str, device: Any, group: Any = None,
                 max_sequence_length: int = 512, resident_blocks: int | str = 0, weights: str = "auto"):
        import diffusers
        import torch

        import dlo.engine
        from dlo.engine.families import FAMILIES

        self.facts = PipelineFacts.from_dir(model_dir)
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.tick: Callable[[], None] = lambda: None
        self.steps_done = 0  # denoising steps of the running request (read by the progress reporter)
        t0 = time.perf_counter()
        self.model = dlo.engine.load(Path(model_dir) / "transformer", mode=mode, device=self.device, group=group,
                                     resident_blocks=resident_blocks, weights=weights)  # type: ignore[arg-type]
        compute_dtype = next(p.dtype for p in self.model.module.parameters() if p.is_floating_point())
        cls = getattr(diffusers, self.facts.pipeline_class)
        # The VAE's output becomes the image bytes: it stays float32 whatever the transformer runs in.
        self.pipe = cls.from_pretrained(
            model_dir, transformer=self.model.module,
            torch_dtype={"default": compute_dtype, "vae": torch.float32},
        )
        self.pipe.set_progress_bar_config(disable=True)
        self.component_bytes: dict[str, int] = {}
        for name, comp in self.pipe.components.items():
            if name == "transformer" or not isinstance(comp, torch.nn.Module):
                continue
            comp.to(self.device)
            comp.eval()
            self.component_bytes[name] = sum(p.numel() * p.element_size() for p in comp.parameters())
        family = FAMILIES[self.facts.family]
        for list_name in family.block_lists:
            for block in getattr(self.model.module, list_name):
                block.register_forward_pre_hook(lambda *_: self.tick())
        self.load_seconds = time.perf_counter() - t0
        log.info("pipeline loaded family=%s mode=%s device=%s components=%s seconds=%.2f", self.facts.family,
                 mode, self.device, self.component_bytes, self.load_seconds)

    @property
    def report(self) -> Any:
        return self.model.report

    def stats(self) -> dict[str, float]:
        s = self.model.stats()
        peak = self.model.platform.memory_peak(self.device)
        return {"h2d_bytes": s.h2d_bytes, "collective_bytes": s.collective_bytes,
                "gather_wait_seconds": s.gather_wait_seconds, "gathers": s.gathers,
                "device_memory_peak_bytes": peak}

    def gather_only(self, gen: Generation) -> None:
        """Idle rank in a partial wave: the gathers of every transformer call `gen` implies."""
        for _ in range(self.facts.transformer_calls(gen)):
            self.model.gather_only(1)
            self.tick()

    def _call_kwargs(self, gen: Generation) -> dict[str, Any]:
        import torch

        kw: dict[str, Any] = dict(
            prompt=gen.prompt, negative_prompt=gen.negative_prompt, height=gen.height, width=gen.width,
            num_inference_steps=gen.steps, guidance_scale=gen.guidance_scale,
            # A CPU generator makes the initial noise identical on every device and rank.
            generator=torch.Generator("cpu").manual_seed(gen.seed), output_type="np",
            max_sequence_length=self.max_sequence_length,
        )
        if self.facts.family == "wan":
            kw.update(num_frames=gen.frames, num_videos_per_prompt=gen.n)
        else:
            kw.update(num_images_per_prompt=gen.n, true_cfg_scale=gen.guidance_scale if self.facts.uses_cfg(gen) else 1.0)
        return kw

    def run(self, gen: Generation) -> RunResult:
        import numpy as np
        import torch

        t0 = time.perf_counter()
        steps: list[float] = []
        last = [t0]

        def on_step(_pipe: Any, i: int, _t: Any, kwargs: dict) -> dict:
            now = time.perf_counter()
            steps.append(now - last[0])
            last[0] = now
            self.steps_done = i + 1
            self.tick()
            return kwargs

        self.steps_done = 0
        self.tick()
        with torch.inference_mode():
            out = self.pipe(**self._call_kwargs(gen), callback_on_step_end=on_step)
        self.tick()
        if self.facts.family == "wan":
            videos = np.asarray(out.frames)  # (n, frames, H, W, 3)
            if gen.kind == "video":
                result = RunResult([encode_mp4(videos[0], gen.fps)], "video/mp4")
            else:
                result = RunResult([encode_png(v[0]) for v in videos], "image/png")
        else:
            result = RunResult([encode_png(img) for img in np.asarray(out.images)], "image/png")
        self.tick()
        result.step_seconds = steps
        result.seconds = time.perf_counter() - t0
        return result
