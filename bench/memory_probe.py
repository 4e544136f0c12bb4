"""One family's device-memory measurements, in its own process (`bench/memory.py run` starts it).

Owns: loading a (reduced-layer) pipeline folder's parts the way `dlo serve` places them (the
transformer and the large text encoder through `dlo.engine.load` in rank-local mode with every
block streamed; CLIP, the image encoder and the VAE whole, the VAE in float32), and measuring each
phase of a request at each shape of the family's plan: the allocator's allocated and reserved bytes
before and at the peak, from an emptied cache (`measure`). Also the weights each load placed, the
device memory outside the allocator (CUDA context, kernels) and one whole pipeline call in plain
diffusers as a check of the sum of the parts. The raw record is rewritten after every measurement,
so a process cut short keeps what it measured.
Must never: cap the allocator or set PYTORCH_CUDA_ALLOC_CONF (the table is for `dlo serve`'s
allocator, uncapped: a cap makes the allocator release its cache, which hides fragmentation), or
fit anything (the merge step does).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from dlo.engine.peaks_transformer import transformer_inputs
from dlo.plan.memory_model import Shape

SEED = 0
CLIP_MAX_TOKENS = 77
QWEN_TEMPLATE_TOKENS = 34  # Qwen-Image's prompt template, dropped after the encoder (pipeline_qwenimage)


class Probe:
    """The measurements of one family: `run(plan)` writes `raw` after each step."""

    def __init__(self, model: Path, raw: Path, device: str, deadline: float) -> None:
        import torch

        from dlo.engine.families import pipeline_facts

        self.torch = torch
        self.model, self.raw_path, self.device, self.deadline = model, raw, torch.device(device), deadline
        self.cuda = self.device.type == "cuda"
        self.facts = pipeline_facts(model)
        self.index = json.loads((model / "model_index.json").read_text())
        self.raw: dict[str, Any] = {"family": self.facts.family, "model": str(model), "device": str(device),
                                    "loads": {}, "phases": [], "skipped": []}
        self.parts: dict[str, Any] = {}
        self.dtype = torch.float32

    # ---- bookkeeping -------------------------------------------------------------------------
    def save(self) -> None:
        tmp = self.raw_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.raw, indent=1) + "\n")
        os.replace(tmp, self.raw_path)

    def out_of_time(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.raw["skipped"].append(what)
        return True

    def stats(self) -> tuple[int | None, int | None]:
        if not self.cuda:
            return None, None
        return self.torch.cuda.memory_allocated(self.device), self.torch.cuda.memory_reserved(self.device)

    def measure(self, part: str, shape: Shape | None, fn: Callable[[], Any], **extra: Any) -> None:
        """One phase from an emptied cache: allocated/reserved before, and their peaks during `fn`."""
        torch = self.torch
        record: dict[str, Any] = {"part": part, **({"shape": _shape_dict(shape)} if shape else {}), **extra}
        if self.out_of_time(f"{part} {shape or ''}".strip()):
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        base_a, base_r = self.stats()
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = fn()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            del out
        except Exception as e:  # one phase out of memory (or broken) is recorded and the rest go on
            record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        record["seconds"] = round(time.perf_counter() - t0, 3)
        record.update(base_allocated=base_a, base_reserved=base_r,
                      peak_allocated=torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
                      peak_reserved=torch.cuda.max_memory_reserved(self.device) if self.cuda else None)
        self.raw["phases"].append(record)
        self.save()

    # ---- loading -----------------------------------------------------------------------------
    def load_streamed(self, name: str) -> Any:
        """A component through `dlo.engine.load`, rank-local, every block streamed (what serves)."""
        import dlo.engine
        from dlo.engine.blocks import describe
        from dlo.plan.memory_model import placed_weight_bytes
        from dlo.engine.settings import OffloadSettings

        before = self.stats()
        m = dlo.engine.load(self.model / name, settings=OffloadSettings(mode="rank-local"), device=self.device)
        self._record_load(name, before, placed_weight_bytes(describe(self.model / name), "rank-local"),
                          report=m.report.to_dict())
        return m

    def load_whole(self, name: str, dtype: Any) -> Any:
        """A component from its folder with diffusers or transformers, whole on the device."""
        import diffusers
        import transformers

        from dlo.engine.checkpoint import cached_checkpoint

        lib, cls = self.index[name]
        before = self.stats()
        # transformers 5 names the argument `dtype`; diffusers 0.42 still takes `torch_dtype` as the bench always has
        kw = {"torch_dtype": dtype} if lib == "diffusers" else {"dtype": dtype}
        module = getattr(diffusers if lib == "diffusers" else transformers, cls).from_pretrained(
            self.model / name, **kw).to(self.device).eval()
        self._record_load(name, before, cached_checkpoint(self.model / name).nbytes)
        return module

    def _record_load(self, name: str, before: tuple, expected: float, **extra: Any) -> None:
        if self.cuda:  # what the weights keep, not the load's transient buffers
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()
        after = self.stats()
        delta = {} if before[0] is None else {"allocated": after[0] - before[0], "reserved": after[1] - before[1]}
        self.raw["loads"][name] = {"expected_bytes": int(expected), **delta, **extra}
        self.save()

    def load_parts(self) -> None:
        """Every component a request runs, placed as `dlo serve` places them in rank-local mode."""
        torch = self.torch
        self.parts["transformer"] = self.load_streamed("transformer")
        self.dtype = self.parts["transformer"].compute_dtype
        streamable = set(self.facts.adapter.streamable_encoders)
        for name, spec in self.index.items():
            if name in ("transformer", "transformer_2") or not isinstance(spec, list) or spec[0] is None:
                continue
            if not (self.model / name / "config.json").is_file():
                continue  # tokenizers, scheduler, image processor
            if name in streamable:
                self.parts[name] = self.load_streamed(name)
            else:
                self.parts[name] = self.load_whole(name, torch.float32 if name == "vae" else self.dtype)

    # ---- the phases --------------------------------------------------------------------------
    def run(self, plan: Any) -> None:
        self.raw["plan"] = plan.to_dict()
        self.load_parts()
        for name in sorted(n for n in self.parts if n.startswith("text_encoder")):
            for seq in plan.sequences:
                self.measure(name, None, lambda: self.text_encoder(name, seq), sequence=seq)
        if "image_encoder" in self.parts:
            self.measure("image_encoder", None, self.image_encoder)
        for shape in plan.transformer:
            self.measure("transformer", shape, lambda: self.transformer(shape, plan.sequences[-1]))
        for tiled in (False, True):
            for shape in plan.vae:
                self.measure("vae_decode_tiled" if tiled else "vae_decode", shape, lambda: self.vae_decode(shape, tiled))
            for shape in plan.encode:
                self.measure("vae_encode_tiled" if tiled else "vae_encode", shape, lambda: self.vae_encode(shape, tiled))
        self.raw["context_bytes"] = self.context_bytes()
        self.save()
        if plan.validate is not None and not self.out_of_time("validation"):
            self.validate(plan.validate)

    def text_encoder(self, name: str, seq: int) -> Any:
        torch = self.torch
        part = self.parts[name]
        module = getattr(part, "module", part)
        cls = self.index[name][1]
        n = min(seq, CLIP_MAX_TOKENS) if cls.startswith("CLIP") else seq + (
            QWEN_TEMPLATE_TOKENS if cls.startswith("Qwen") else 0)
        ids = torch.randint(4, 260, (1, n), device=self.device)
        if cls.startswith("CLIP"):
            return module(input_ids=ids, output_hidden_states=False)
        mask = torch.ones_like(ids)
        if cls.startswith("Qwen"):
            return module(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return module(input_ids=ids, attention_mask=mask)

    def image_encoder(self) -> Any:
        enc = self.parts["image_encoder"]
        size = enc.config.image_size
        pixels = self.torch.randn(1, 3, size, size, device=self.device, dtype=self.dtype)
        return enc(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]

    def transformer(self, shape: Shape, text_len: int) -> Any:
        module = self.parts["transformer"].module
        return module(**transformer_inputs(self.facts.family, dict(module.config), shape, text_len,
                                           self._image_tokens(), self.dtype, self.device), return_dict=False)[0]

    def _image_tokens(self) -> int:
        enc = self.parts.get("image_encoder")
        if enc is None:
            return 0
        return (enc.config.image_size // enc.config.patch_size) ** 2 + 1

    def vae_decode(self, shape: Shape, tiled: bool) -> Any:
        from dlo.engine.peaks import decode_random

        return decode_random(self.parts["vae"], self.facts, shape, self.device, tiled=tiled)

    def vae_encode(self, shape: Shape, tiled: bool) -> Any:
        """Image-to-video's condition: the first frame then zeros, encoded (WanImageToVideoPipeline)."""
        torch = self.torch
        vae = self.parts["vae"]
        vae.enable_tiling() if tiled else vae.disable_tiling()
        image = torch.rand(shape.batch, 3, 1, shape.height, shape.width, device=self.device) * 2 - 1
        video = torch.cat([image, image.new_zeros(shape.batch, 3, shape.frames - 1, shape.height, shape.width)], dim=2)
        return vae.encode(video).latent_dist.mode()

    def context_bytes(self) -> dict[str, int] | None:
        """Device memory this process holds outside the allocator (context, loaded kernels)."""
        if not self.cuda:
            return None
        torch = self.torch
        free, total = torch.cuda.mem_get_info(self.device)
        out = {"device_used_minus_reserved": total - free - torch.cuda.memory_reserved(self.device),
               "total_bytes": total}
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device.index or 0)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    out["process_minus_reserved"] = int(p.usedGpuMemory) - torch.cuda.memory_reserved(self.device)
        except Exception as e:  # NVML missing or no per-process figure: the mem_get_info one stands
            out["nvml"] = f"unavailable: {type(e).__name__}"
        return out

    def validate(self, shape: Shape) -> None:
        """One plain-diffusers call of the whole pipeline, resident, 2 steps: its peak beyond the
        weights, to hold against the largest part the merge predicts at that shape."""
        from bench.diffusers_baseline import load_pipeline, pipeline_call

        torch = self.torch
        for part in list(self.parts.values()):  # the measured parts leave the device first
            getattr(part, "close", lambda: None)()
        self.parts.clear()
        if self.cuda:
            torch.cuda.empty_cache()
        record: dict[str, Any] = {"shape": _shape_dict(shape), "steps": 2}
        try:
            pipe = load_pipeline(self.model, str(self.device), "resident")
            record["loaded_allocated"] = self.stats()[0]
            self.measure("pipeline", shape, lambda: pipeline_call(pipe, self.facts, shape, steps=2,
                                                                  max_sequence_length=self.raw["plan"]["sequences"][-1]))
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}"[:500]
        self.raw["validation"] = record
        self.save()


def _shape_dict(shape: Shape) -> dict[str, int]:
    return {"width": shape.width, "height": shape.height, "frames": shape.frames, "batch": shape.batch}


def probe_main(model: Path, raw: Path, device: str, budget_s: float, plan: Any) -> int:
    probe = Probe(model, raw, device, time.monotonic() + budget_s)
    try:
        probe.run(plan)
    except Exception:  # a failure outside one phase (a load): recorded, and the parent sees exit 1
        probe.raw["error"] = traceback.format_exc()[-3000:]
        probe.save()
        return 1
    return 0
