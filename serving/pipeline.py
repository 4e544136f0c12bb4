"""A diffusers pipeline on the DLO engine, run one request at a time (`ServingPipeline`).

Owns: building the family's diffusers pipeline (looked up from its adapter in
`dlo.engine.families`) with the transformer from `dlo.engine.load` in place of diffusers' own,
the progress ticks of a rank (a pre-hook on every block, through `dlo.engine.hooks`), the rank's LoRA
adapters (`dlo.engine.lora.LoraBank`: applied to the request's transformer forwards only), and running
one request through the pipeline's single-request path into encoded PNG or MP4 bytes (`encode.py`).
Everything family-specific (pipeline class, call count, call arguments, output decoding) is the
adapter's.
Must never: branch on a family name, batch requests of different ranks together, hold test-only
code (the fault seam wraps its phases from outside: `dlo.serving.faults`), or touch the
collective schedule except through `dlo.engine.load`'s module and `gather_only` (every rank of a
wave must issue the same gathers in the same order).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dlo.engine.energy import rank_meter
from dlo.engine.families import Decoded, pipeline_facts
from dlo.engine.families.pipelines import decode_in_own_dtype
from dlo.engine.report import GatherStats
from dlo.serving import distmap
from dlo.serving.control import RankStats
from dlo.serving.encode import encode
from dlo.serving.prewarm import join_logged, start_beside_imports
from dlo.engine.settings import EngineSettings
from dlo.plan.resident import VAE_TILE_ABOVE_PIXELS
from dlo.engine.timing import Laps, PhaseClock
from dlo.engine.request import Generation

log = logging.getLogger(__name__)
__all__ = ["ServingPipeline", "RunResult", "VAE_TILE_ABOVE_PIXELS"]


@dataclass
class RunResult:
    outputs: list[bytes]  # PNG per image, or one MP4
    media_type: str  # "image/png" | "video/mp4"
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # prepare, denoise, decode, encode_output


class ServingPipeline:
    """A diffusers pipeline whose transformer runs through DLO, run one request at a time.

    `tick` (settable) is called before every transformer block and at every phase boundary: the
    rank's progress signal for the wave watchdog.
    """

    def __init__(self, model_dir: Path | str, settings: EngineSettings, *, device: Any = None, group: Any = None,
                 parallel: Any = None, max_sequence_length: int = 512):
        """`settings` as every rank got them (`RankConfig`); `device`: this rank's device (default:
        `settings.device`); `group`: the shard group; `parallel`: the dp x sp groups (`make_groups`).

        The steps, in order (each a method, torchtitan's `parallelize_*` style): configure (facts,
        device, cap), start the readahead and the library warm-up beside the imports (`prewarm.py`),
        load the engine's models (resident copies left in flight), parallelize (dp x sp), build the
        diffusers pipeline around them, place its other components, attach the progress hooks,
        settle the copies, load the LoRA adapters, join the readahead. `phases=` of the "pipeline loaded"
        log line (`load_phases`) times them. A step that fails closes the models already loaded."""
        t0 = time.perf_counter()
        laps = Laps(t0)
        self._configure(Path(model_dir), settings, device, max_sequence_length)
        engine_models = (*self.facts.transformers, *self.encoders)
        readahead, libraries = start_beside_imports(self.model_dir, engine_models, self.device)
        with distmap.installed():  # [Note: packages_distributions at import] in distmap.py
            self.models = self._load_models(group, laps, libraries, readahead)
        try:
            self.model = self.models[self.facts.transformers[0]]
            self._parallelize(parallel)
            self.pipe = self._build_pipeline()
            laps.lap("from_pretrained")
            self.component_bytes = self._place_components()
            laps.lap("components_to_device")
            self._attach_progress_hooks()
            for m in self.models.values():  # the resident copies issued beside the steps above: the
                m.settle()                  # compute stream waits for them (the LoRA bank reads them)
            laps.lap("settle")
            self.lora, self.pairs, self.caches = self._adapters_and_pairs()
            laps.lap("lora")
        except BaseException:
            self.close()  # nothing stays registered, pinned or in flight
            raise
        join_logged(readahead)
        laps.lap("readahead_join")
        self.load_seconds = time.perf_counter() - t0
        self.load_phases = laps.rounded()
        log.info("pipeline loaded family=%s mode=%s device=%s components=%s seconds=%.2f phases=%s",
                 self.facts.family, self.mode, self.device, self.component_bytes, self.load_seconds, self.load_phases)

    # -- the steps of __init__, in order ---------------------------------------------------------
    def _configure(self, model_dir: Path, settings: EngineSettings, device: Any, max_sequence_length: int) -> None:
        """What the folder is, which models the engine loads, the device (capped where asked) and
        the request-independent state."""
        import torch

        self.model_dir, self.settings, self.mode = model_dir, settings, settings.offload.mode
        self.facts = pipeline_facts(model_dir)
        self.adapter = self.facts.adapter
        # `stream_encoders` (`dlo serve`'s default): the large text encoders load through the engine
        # after the transformers: streamed when offloaded, whole in `resident` mode, their copies from
        # the registered page cache (diffusers' pageable copies: 1.5 s for Wan's UMT5 on an H200).
        self.encoders = self.adapter.streamable_encoders if settings.stream_encoders else ()
        self.device = torch.device(settings.device if device is None else device)
        self.energy = rank_meter(self.device)  # `dlo_device_energy_joules_total`; None without NVML's counter
        self.max_sequence_length = max_sequence_length
        self.tick: Callable[[], None] = lambda: None
        self.steps_done = 0  # denoising steps of the running request (read by the progress reporter)
        self.clock = PhaseClock()  # the running request's phase; the seconds of each (the last request's)
        # the deployment's tiling rule (`dlo serve` resolves it from the device budget: memory_plan)
        self.vae_tile_above_pixels = settings.vae_tile_above_pixels
        if settings.max_device_memory:
            from dlo.engine.platform import cap_device_memory

            fraction = cap_device_memory(self.device, settings.max_device_memory)
            log.info("device memory capped at %d bytes (%.4f of the device)", settings.max_device_memory, fraction)

    def _load_models(self, group: Any, laps: Laps, libraries: Any = None, readahead: Any = None) -> dict[str, Any]:
        """Every transformer of the pipeline (Wan2.2: two experts) through its own `dlo.engine.load`, in
        the same mode, shard group and order on every rank (each load gathers its first block), then the
        streamed encoders. The page cache is pinned on a thread (`early_registration`) beside the imports
        (GIL-bound); on a cold start after `readahead`'s first files (pinning reads the weights)."""
        import dlo.engine

        streamed = (*self.facts.transformers, *self.encoders)
        early: dict[str, Any] = {}
        models: dict[str, Any] = {}
        try:
            for name in streamed:
                early[name] = dlo.engine.early_registration(self.model_dir / name, self.device,
                                                            self.settings.offload, readahead)
            import diffusers  # noqa: F401  (the longest import, beside the registrations)

            laps.lap("imports")
            kept = self._resident_blocks(streamed, group)
            # before the loads: no device work of another thread beside their graph captures
            join_logged(libraries)
            laps.lap("library_warmup_join")
            for name in streamed:
                # FP8 streaming is the transformers' (`dlo quantize` converts only them): the text
                # encoders stream (or sit resident) in their own dtype (same bytes in every mode)
                dtype = self.settings.offload.stream_dtype if name in self.facts.transformers else "bfloat16"
                settings = self.settings.offload.but(resident_blocks=kept[name], stream_dtype=dtype)
                models[name] = dlo.engine.load(self.model_dir / name, settings=settings, device=self.device,
                                               group=group, early=early.pop(name), settle=False)
        except BaseException:
            for m in models.values():  # a later load failed: nothing stays pinned
                m.close()
            raise
        finally:
            for reg in early.values():  # registrations whose load never ran (something before it failed)
                if reg is not None:
                    reg.release()
        laps.lap("engine_models")
        return models

    def _parallelize(self, parallel: Any) -> None:
        """dp x sp (`dlo.engine.parallel.ParallelGroups`): the ranks of an sp group run one request
        together (every transformer sequence-parallel); only the group's first rank returns the output."""
        self.sp = parallel.layout.sp if parallel is not None else 1
        self.returns_outputs = parallel is None or parallel.layout.is_leader(parallel.rank)
        if parallel is None:
            return
        from dlo.engine.parallel import enable_sequence_parallel

        for name in self.facts.transformers:
            enable_sequence_parallel(self.models[name].module, parallel, self.device)

    def _build_pipeline(self) -> Any:
        """The family's pipeline, with the engine's models in place (the VAE float32: it makes the bytes)."""
        import torch

        pipe = self.adapter.build_pipeline(self.model_dir, {name: m.module for name, m in self.models.items()},
                                           self.model.compute_dtype, self.device,
                                           safety_checker=self.settings.safety_checker)
        pipe.set_progress_bar_config(disable=True)
        if isinstance(getattr(pipe, "vae", None), torch.nn.Module):
            decode_in_own_dtype(pipe.vae)
        return pipe

    def _place_components(self) -> dict[str, int]:
        """The pipeline's other modules (VAE, small encoders, ...) whole onto the device; their bytes."""
        import torch

        placed: dict[str, int] = {}
        for name, comp in self.pipe.components.items():
            if name in self.models or not isinstance(comp, torch.nn.Module):
                continue
            comp.to(self.device)
            comp.eval()
            placed[name] = sum(p.numel() * p.element_size() for p in comp.parameters())
        return placed

    def _attach_progress_hooks(self) -> None:
        """The watchdog's progress signal (one tick before every block of every engine model), the
        phase a transformer's first block enters, and per model the forwards that ran their whole
        block walk (what a failed request still owes the wave's gathers is counted from them)."""
        from dlo.engine.hooks import HookSet

        self.hooks = HookSet()
        self.calls_done: dict[str, int] = {name: 0 for name in self.models}
        for name in self.models:
            blocks = self.blocks(name)
            for block in blocks:
                self.hooks.add_pre(block, lambda *_: self.tick())
            if name in self.facts.transformers:
                self.hooks.add_pre(blocks[0], lambda *_: setattr(self, "phase", "denoise"))
            self.hooks.add_post(blocks[-1], lambda *_, n=name: self.calls_done.__setitem__(n, self.calls_done[n] + 1))

    def blocks(self, name: str) -> list[Any]:
        """The blocks of engine model `name` (a transformer or a streamed encoder), in execution order."""
        from dlo.engine.families import family_of

        module = self.models[name].module
        return [b for list_name in family_of(type(module).__name__).block_lists
                for b in module.get_submodule(list_name)]

    @property
    def phase(self) -> str:
        """The phase the running request is in: idle, prepare (text encoding, scheduler set-up,
        latents), denoise, decode, encode_output (`RequestError.phase`); each change adds the time
        spent in the one left to `clock.seconds`."""
        return self.clock.phase

    @phase.setter
    def phase(self, name: str) -> None:
        self.clock.enter(name)

    def _adapters_and_pairs(self) -> tuple[Any, Any, Any]:
        """`--lora-dir`'s adapters (`LoraBank`), `--cfg-pairs` (`ModelPairs` over the streamed transformers, else
        `NO_PAIRS`; made first: the adapters then keep a block's merges for the second lane) and `StepCaches`."""
        from dlo.engine.cfg_pairs import NO_PAIRS, CfgPairs, ModelPairs, pairing_on
        from dlo.engine.lora.bank import LoraBank
        from dlo.engine.step_cache import StepCaches

        streamed = [self.models[n] for n in self.facts.transformers if self.models[n].prefetcher is not None]
        on = pairing_on(self.settings.cfg_pairs, self.mode, self.settings.parallel.sp, self.device.type,
                        self.adapter.cfg_pairs, bool(streamed))
        first = self.facts.transformers[0]
        lora = LoraBank.load(self.settings.lora, self.facts.pipeline_class, self.model_dir / first,
                             self.models[first], self.device, keep_blocks=on)
        pairs = ModelPairs([CfgPairs(m.module, m.prefetcher, self.device) for m in streamed]) if on else NO_PAIRS
        return lora, pairs, StepCaches([self.models[n] for n in self.facts.transformers])

    def _resident_blocks(self, streamed: tuple[str, ...], group: Any) -> dict[str, int]:
        """Blocks each streamed model keeps on the device: as given, or `--resident-blocks auto`'s plan
        (`dlo.plan.memory_plan`) within this rank's device room, the shard group agreeing on the
        smallest; with no plan (no device budget known: cpu) none."""
        from dlo.plan.memory_plan import within
        from dlo.engine.offload import agree_on_resident_blocks
        from dlo.engine.platform import get_platform

        settings = self.settings
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
        """This rank's counters: every streamed model's gathers and the caches' skips together, the allocator's peak."""
        total = GatherStats.total([*(m.stats() for m in self.models.values()), self.caches.stats()])
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
        whose request failed already ran; they form a prefix of the plan); planned in a wave with a cache."""
        with self.caches.gathering(gen):
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

    def pipeline_kwargs(self, gen: Generation) -> dict[str, Any]:
        """The arguments of the diffusers pipeline's call for `gen` (the family's own among them)."""
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
            if i + 1 == gen.steps:
                self.phase = "decode"
            return kwargs

        self.steps_done = 0
        self.clock.reset()
        self.phase = "prepare"  # text encoding, scheduler set-up, latents
        self.tick()
        self.set_vae_tiling(gen)
        with torch.inference_mode(), self.lora.applied(gen.lora_id, gen.lora_scale, self.facts.call_tokens(gen)), \
                self.caches.request(gen, self.pairs, self.adapter.uses_cfg(gen)):
            out = self.adapter.run(self.pipe, self.pipeline_kwargs(gen), on_step)
        self.tick()
        self.phase = "encode_output"
        result = RunResult(*self.encode_output(self.adapter.decode(out, gen), gen.fps))
        self.phase = "idle"
        self.tick()
        result.step_seconds, result.seconds = steps, time.perf_counter() - t0
        result.phase_seconds = dict(self.clock.seconds)
        return result

    def encode_output(self, decoded: Decoded, fps: int) -> tuple[list[bytes], str]:
        """The decoded frames as the response's bytes: PNG per image, or one MP4 (`encode.py`)."""
        return encode(decoded, fps)

    def set_vae_tiling(self, gen: Generation) -> bool:
        """Tiled VAE decoding for requests above `vae_tile_above_pixels` decoded pixels (the same rule
        on every rank and in every mode, so bytes stay identical across them); returns whether on."""
        vae = getattr(self.pipe, "vae", None)
        tiled = self.adapter.decode_tiled(gen, self.vae_tile_above_pixels)
        if vae is not None and hasattr(vae, "enable_tiling"):
            if tiled:
                vae.enable_tiling()
            else:
                vae.disable_tiling()
        return tiled

    def close(self) -> None:
        """Remove the progress hooks and release the engine's models and the adapters (also after a
        failed start)."""
        if hasattr(self, "hooks"):  # attached by a late step of __init__
            self.hooks.remove()
        if hasattr(self, "pairs"):
            self.pairs.close()
        if hasattr(self, "lora"):
            self.lora.close()
        for m in self.models.values():
            m.close()
