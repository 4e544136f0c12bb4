"""A diffusers pipeline on the DLO engine, run one request at a time (`ServingPipeline`).

Owns: building the family's diffusers pipeline (looked up from its adapter in
`dlo.engine.families`) with the transformer from `dlo.engine.load` in place of diffusers' own,
the progress ticks of a rank (a pre-hook on every block, through `dlo.engine.hooks`), the rank's LoRA
adapters (`dlo.engine.lora.LoraBank`: applied to the request's transformer forwards only), and running
one request through the pipeline's single-request path into encoded PNG or MP4 bytes (`encode.py`).
Everything family-specific (pipeline class, call count, call arguments, output decoding) is the
adapter's.
Must never: branch on a family name, batch requests of different ranks together, install the
test-only fault hooks unless `dlo.engine.serving.faults` says so, or touch the collective schedule except through `dlo.engine.load`'s module and `gather_only` (every rank of a
wave must issue the same gathers in the same order).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dlo.engine.families import pipeline_facts
from dlo.engine.report import GatherStats
from dlo.engine.serving.control import RankStats
from dlo.engine.serving.encode import encode
from dlo.engine.memory_model import Shape, decoded_pixels
from dlo.engine.settings import VAE_TILE_ABOVE_PIXELS, EngineSettings
from dlo.engine.timing import Laps
from dlo.engine.request import Generation

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    outputs: list[bytes]  # PNG per image, or one MP4
    media_type: str  # "image/png" | "video/mp4"
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0


__all__ = ["ServingPipeline", "RunResult", "VAE_TILE_ABOVE_PIXELS", "decode_in_own_dtype"]


def decode_in_own_dtype(vae: Any) -> None:
    """Cast the latents to the VAE's dtype on the way in: the VAE runs in float32 (its output becomes
    the bytes) while Flux and QwenImage hand it latents in the transformer's dtype (bfloat16)."""
    inner = vae.decode

    def decode(z: Any, *args: Any, **kwargs: Any) -> Any:
        return inner(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode  # type: ignore[method-assign]


class ServingPipeline:
    """A diffusers pipeline whose transformer runs through DLO, run one request at a time.

    `tick` (settable) is called before every transformer block and at every phase boundary: the
    rank's progress signal for the wave watchdog.
    """

    def __init__(self, model_dir: Path | str, settings: EngineSettings, *, device: Any = None, group: Any = None,
                 parallel: Any = None, max_sequence_length: int = 512):
        """`settings` as every rank got them (`RankConfig`); `device`: this rank's device (default:
        `settings.device`); `group`: the shard group; `parallel`: the dp x sp groups (`make_groups`)."""
        t0 = time.perf_counter()
        mode = settings.offload.mode
        # where the load time goes (the `phases=` of the "pipeline loaded" log): imports (with the
        # cap and the registrations started), streamed models, the rest of the pipeline from its
        # files, the resident components moved to the device
        laps = Laps(t0)
        import torch

        from dlo.engine.offload import early_registration

        self.facts = pipeline_facts(model_dir)
        self.adapter = self.facts.adapter
        # With `stream_encoders` (off in process by default; `dlo serve` turns it on unless told not
        # to), the family's large text encoders stream the same way as the transformers (their own
        # block lists), loaded after them.
        self.encoders = self.adapter.streamable_encoders if settings.stream_encoders and mode != "resident" else ()
        streamed = (*self.facts.transformers, *self.encoders)
        self.device = torch.device(settings.device if device is None else device)
        self.max_sequence_length = max_sequence_length
        self.tick: Callable[[], None] = lambda: None
        self.steps_done = 0  # denoising steps of the running request (read by the progress reporter)
        # the deployment's tiling rule (`dlo serve` resolves it from the device budget: memory_plan)
        self.vae_tile_above_pixels = settings.vae_tile_above_pixels
        if settings.max_device_memory:
            from dlo.engine.platform import cap_device_memory

            fraction = cap_device_memory(self.device, settings.max_device_memory)
            log.info("device memory capped at %d bytes (%.4f of the device)", settings.max_device_memory, fraction)
        # The driver pins the streamed models' page cache on a thread while the imports below and the
        # model builds run (they hold the GIL; the registration does not): `dlo.engine.weights`.
        early: dict[str, Any] = {}
        self.models: dict[str, Any] = {}
        try:
            for name in streamed:
                early[name] = early_registration(Path(model_dir) / name, self.device, settings.offload)
            import diffusers  # noqa: F401  (the imports lap: the family builds its pipeline with it)

            import dlo.engine
            from dlo.engine.hooks import HookSet

            laps.lap("imports")
            kept = self._resident_blocks(settings, streamed, group)
            # Every transformer of the pipeline (Wan2.2: two experts) streams through its own load, in
            # the same mode and shard group, loaded in the same order on every rank (each load gathers
            # its first block: the collective order starts here); then the streamed encoders.
            for name in streamed:
                # FP8 streaming is the transformers' (`dlo quantize` converts only them): in resident mode the
                # text encoders load whole in their own dtype, so they stream in it too (same bytes in every mode)
                dtype = settings.offload.stream_dtype if name in self.facts.transformers else "bfloat16"
                self.models[name] = dlo.engine.load(
                    Path(model_dir) / name, settings=settings.offload.but(resident_blocks=kept[name], stream_dtype=dtype),
                    device=self.device, group=group, early=early.pop(name))
        except BaseException:
            for m in self.models.values():  # a later load failed: nothing stays pinned
                m.close()
            raise
        finally:
            for reg in early.values():  # registrations whose load never ran (something before it failed)
                if reg is not None:
                    reg.release()
        self.model = self.models[self.facts.transformers[0]]
        laps.lap("streamed_models")
        # dp x sp (`dlo.engine.parallel.ParallelGroups`): the ranks of an sp group run one request
        # together (every transformer sequence-parallel); only the group's first rank returns the output.
        from dlo.engine.parallel import enable_sequence_parallel

        self.sp = parallel.layout.sp if parallel is not None else 1
        self.returns_outputs = parallel is None or parallel.layout.is_leader(parallel.rank)
        if parallel is not None:
            for name in self.facts.transformers:
                enable_sequence_parallel(self.models[name].module, parallel, self.device)
        # The family's pipeline with the streamed modules in place (the VAE stays float32: its output
        # becomes the bytes).
        self.pipe = self.adapter.build_pipeline(Path(model_dir), {name: m.module for name, m in self.models.items()},
                                                self.model.compute_dtype, self.device,
                                                safety_checker=settings.safety_checker)
        self.pipe.set_progress_bar_config(disable=True)
        if isinstance(getattr(self.pipe, "vae", None), torch.nn.Module):
            decode_in_own_dtype(self.pipe.vae)
        laps.lap("from_pretrained")
        self.component_bytes: dict[str, int] = {}
        for name, comp in self.pipe.components.items():
            if name in self.models or not isinstance(comp, torch.nn.Module):
                continue
            comp.to(self.device)
            comp.eval()
            self.component_bytes[name] = sum(p.numel() * p.element_size() for p in comp.parameters())
        laps.lap("components_to_device")
        # the watchdog's progress signal: one tick before every transformer block
        self.hooks = HookSet()
        from dlo.engine.families import family_of

        # Per streamed model: forwards that ran their whole block walk (what a failed request still
        # owes the wave's gathers is counted from them), and the phase the running request is in.
        self.calls_done: dict[str, int] = {name: 0 for name in self.models}
        self.phase = "idle"
        for name, m in self.models.items():
            blocks = [b for list_name in family_of(type(m.module).__name__).block_lists
                      for b in m.module.get_submodule(list_name)]
            for block in blocks:
                self.hooks.add_pre(block, lambda *_: self.tick())
            if name in self.facts.transformers:
                self.hooks.add_pre(blocks[0], lambda *_: setattr(self, "phase", "denoise"))
            self.hooks.add_post(blocks[-1], lambda *_, n=name: self.calls_done.__setitem__(n, self.calls_done[n] + 1))
        self.lora = self._load_lora(settings, Path(model_dir))
        laps.lap("lora")
        from dlo.engine.energy import rank_meter

        self.energy = rank_meter(self.device)  # `dlo_device_energy_joules_total`; None without NVML's counter
        self._faults: Any = None  # test-only FaultPlan (`install_faults`)
        self._rank = 0
        self._prompt = ""
        self.load_seconds = time.perf_counter() - t0
        log.info("pipeline loaded family=%s mode=%s device=%s components=%s seconds=%.2f phases=%s",
                 self.facts.family, mode, self.device, self.component_bytes, self.load_seconds, laps.rounded())

    def _load_lora(self, settings: EngineSettings, model_dir: Path) -> Any:
        """The `--lora-dir` adapters on the first transformer, where diffusers' load_lora_weights puts
        them (Wan2.2's second expert gets none), on this rank's device (`dlo.engine.lora.LoraBank`)."""
        from dlo.engine.lora.bank import LoraBank

        first = self.facts.transformers[0]
        return LoraBank.load(settings.lora.directory, self.facts.pipeline_class, model_dir / first,
                             self.models[first], self.device)

    def _resident_blocks(self, settings: EngineSettings, streamed: tuple[str, ...], group: Any) -> dict[str, int]:
        """Blocks each streamed model keeps on the device: as given, or `--resident-blocks auto`'s plan
        (`dlo.engine.memory_plan`) within this rank's device room, the shard group agreeing on the
        smallest; with no plan (no device budget known: cpu) none."""
        from dlo.engine.memory_plan import within
        from dlo.engine.offload import agree_on_resident_blocks
        from dlo.engine.platform import get_platform

        asked = settings.offload.resident_blocks
        if asked != "auto" or settings.mode == "resident":
            return {name: 0 if asked == "auto" else asked for name in streamed}
        plan = settings.resident_plan
        if plan is None:
            log.info("resident_blocks=auto: no device budget known (%s): every block streams", self.device.type)
            return {name: 0 for name in streamed}
        room = get_platform(self.device).free_memory(self.device) if self.device.type != "cpu" else None
        counts = within(plan, room)
        agreed = agree_on_resident_blocks({n: counts.get(n, 0) for n in streamed}, settings.mode, group, self.device)
        log.info("resident_blocks=auto on this rank: room=%s planned=%s kept=%s", room, dict(plan.blocks), agreed)
        return agreed

    @property
    def report(self) -> Any:
        return self.model.report

    def component_reports(self) -> dict[str, dict[str, Any]]:
        """Per component: where its weights come from, host bytes held for it, device bytes it holds.
        Transformers: their load report (host: pinned arena or registered page cache of this rank;
        device: the two slots plus resident weights). Others: loaded whole by diffusers onto the device."""
        out: dict[str, dict[str, Any]] = {}
        for name, m in self.models.items():
            r = m.report
            out[name] = {"weights_source": r.weights_source, "host_bytes": r.host_pinned_bytes,
                         "device_bytes": r.slot_bytes + r.resident_bytes}
        for name, nbytes in self.component_bytes.items():
            out[name] = {"weights_source": "resident", "host_bytes": 0, "device_bytes": nbytes}
        if self.lora.adapters:  # every adapter, loaded at start
            out["lora"] = {"weights_source": "resident", "host_bytes": 0, "device_bytes": self.lora.device_bytes}
        return out

    def stats(self) -> RankStats:
        """This rank's counters: every streamed model's gathers together, and the allocator's peak."""
        total = GatherStats.total(m.stats() for m in self.models.values())
        joules = self.energy.joules() if self.energy is not None else None
        return RankStats.of(total, self.model.platform.memory_peak(self.device), joules)

    def call_plan(self, gen: Generation) -> list[tuple[str, int]]:
        """Forwards `gen` implies per streamed model, in the order they run: the streamed text
        encoders (prompt, then CFG's negative), then the transformers."""
        calls = self.adapter.encoder_calls(gen)
        return [(name, calls) for name in self.encoders] + self.adapter.call_plan(gen, self.pipe)

    def gather_only(self, gen: Generation, done: dict[str, int] | None = None) -> None:
        """Idle rank in a partial wave: the gathers of every forward `gen` implies, model by model in
        the order a computing rank runs them - less the forwards in `done` (per model: what a rank
        whose request failed already ran; they form a prefix of the plan)."""
        for name, calls in self.call_plan(gen):
            for _ in range(calls - (done or {}).get(name, 0)):
                self.models[name].gather_only(1)
                self.tick()

    def owed_calls(self, gen: Generation, done: dict[str, int]) -> int:
        """Forwards of `gen` not yet run, given `done` per model."""
        return sum(max(0, calls - done.get(name, 0)) for name, calls in self.call_plan(gen))

    def order_intact(self) -> bool:
        """Whether the wave's gather order still holds in every streamed model (`OffloadedModel.order_intact`)."""
        return all(m.order_intact() for m in self.models.values())

    # -- test-only fault injection (dlo.engine.serving.faults; never installed in production) ------
    def install_faults(self, plan: Any, rank: int) -> None:
        """Wrap the phases a request goes through so `plan` can fail one of them (tests only)."""
        self._faults, self._rank = plan, rank
        pipe = self.pipe

        def wrap(obj: Any, name: str, phase: str) -> None:
            real = getattr(obj, name, None)
            if real is None:  # a pipeline without this phase's method (Cosmos3 tokenizes in its call)
                return

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._fault(phase)
                return real(*args, **kwargs)

            setattr(obj, name, wrapper)

        wrap(pipe, "encode_prompt", "encode")
        wrap(pipe.scheduler, "set_timesteps", "setup")
        wrap(pipe.vae, "decode", "decode")
        blocks = [b for name in self.adapter.blocks.block_lists for b in self.model.module.get_submodule(name)]
        self.hooks.add_pre(blocks[len(blocks) // 2], lambda *_: self._fault("forward"))

    def _fault(self, phase: str) -> None:
        if self._faults is not None:
            self._faults.check(phase, self._rank, self._prompt)

    def _call_kwargs(self, gen: Generation) -> dict[str, Any]:
        import torch

        kw: dict[str, Any] = dict(
            prompt=gen.prompt, negative_prompt=gen.negative_prompt, height=gen.height, width=gen.width,
            num_inference_steps=gen.steps, guidance_scale=gen.guidance_scale,
            # A CPU generator makes the initial noise identical on every device and rank.
            generator=torch.Generator("cpu").manual_seed(gen.seed), output_type="np",
            max_sequence_length=self.max_sequence_length,
        )
        kw.update(self.adapter.call_kwargs(gen))
        kw.update(self.adapter.call_inputs(gen))
        for name in self.adapter.unused_call_args:
            kw.pop(name, None)
        return kw

    def run(self, gen: Generation) -> RunResult:
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
            self._fault("step")
            if i + 1 == gen.steps:
                self.phase = "decode"
            return kwargs

        self.steps_done = 0
        self._prompt = gen.prompt
        self.phase = "prepare"  # text encoding, scheduler set-up, latents
        self.tick()
        self._vae_tiling(gen)
        with torch.inference_mode(), self.lora.applied(gen.lora_id, gen.lora_scale):
            out = self.adapter.run(self.pipe, self._call_kwargs(gen), on_step)
        self.tick()
        self.phase = "encode_output"
        decoded = self.adapter.decode(out, gen)
        self._fault("mp4" if decoded.video is not None else "png")
        result = RunResult(*encode(decoded, gen.fps))
        self.phase = "idle"
        self.tick()
        result.step_seconds = steps
        result.seconds = time.perf_counter() - t0
        return result

    def _vae_tiling(self, gen: Generation) -> bool:
        """Tiled VAE decoding for requests above `vae_tile_above_pixels` decoded pixels (the same rule
        on every rank and in every mode, so bytes stay identical across them); returns whether on."""
        vae = getattr(self.pipe, "vae", None)
        tiled = (self.adapter.vae_always_tiled
                 or decoded_pixels(Shape(gen.width, gen.height, max(1, gen.frames), gen.n)) > self.vae_tile_above_pixels)
        if vae is not None and hasattr(vae, "enable_tiling"):
            if tiled:
                vae.enable_tiling()
            else:
                vae.disable_tiling()
        return tiled

    def close(self) -> None:
        """Remove the progress hooks and release the transformers' weights and the adapters."""
        self.hooks.remove()
        self.lora.close()
        for m in self.models.values():
            m.close()
