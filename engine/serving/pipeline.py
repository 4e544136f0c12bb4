"""A diffusers pipeline on the DLO engine, run one request at a time (`ServingPipeline`).

Owns: building the family's diffusers pipeline (looked up from its adapter in
`dlo.engine.families`) with the transformer from `dlo.engine.load` in place of diffusers' own,
the progress ticks of a rank (a pre-hook on every block, through `dlo.engine.hooks`), and running
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

from dlo.engine.facts import Mode
from dlo.engine.families import pipeline_facts
from dlo.engine.serving.control import RankStats
from dlo.engine.serving.encode import encode
from dlo.engine.serving.waves import Generation

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    outputs: list[bytes]  # PNG per image, or one MP4
    media_type: str  # "image/png" | "video/mp4"
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0


class ServingPipeline:
    """A diffusers pipeline whose transformer runs through DLO, run one request at a time.

    `tick` (settable) is called before every transformer block and at every phase boundary: the
    rank's progress signal for the wave watchdog.
    """

    def __init__(self, model_dir: Path | str, *, mode: Mode, device: Any, group: Any = None,
                 max_sequence_length: int = 512, resident_blocks: int | str = 0, weights: str = "auto",
                 parallel: Any = None):
        import diffusers
        import torch

        import dlo.engine
        from dlo.engine.hooks import HookSet

        self.facts = pipeline_facts(model_dir)
        self.adapter = self.facts.adapter
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.tick: Callable[[], None] = lambda: None
        self.steps_done = 0  # denoising steps of the running request (read by the progress reporter)
        t0 = time.perf_counter()
        self.model = dlo.engine.load(Path(model_dir) / "transformer", mode=mode, device=self.device, group=group,
                                     resident_blocks=resident_blocks, weights=weights)  # type: ignore[arg-type]
        # dp x sp (`dlo.engine.parallel.ParallelGroups`): the ranks of an sp group run one request
        # together; only the group's first rank returns the output.
        from dlo.engine.parallel import enable_sequence_parallel

        self.sp = parallel.layout.sp if parallel is not None else 1
        self.returns_outputs = parallel is None or parallel.layout.is_leader(parallel.rank)
        if parallel is not None:
            enable_sequence_parallel(self.model.module, parallel, self.device)
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
        # the watchdog's progress signal: one tick before every transformer block
        self.hooks = HookSet()
        blocks = [b for name in self.adapter.block_lists for b in getattr(self.model.module, name)]
        for block in blocks:
            self.hooks.add_pre(block, lambda *_: self.tick())
        # Transformer calls that ran their whole block walk (what a failed request still owes the
        # wave's gathers is counted from it) and the phase the running request is in.
        self.calls_done = 0
        self.phase = "idle"
        self.hooks.add_pre(blocks[0], lambda *_: setattr(self, "phase", "denoise"))
        self.hooks.add_post(blocks[-1], lambda *_: setattr(self, "calls_done", self.calls_done + 1))
        self._faults: Any = None  # test-only FaultPlan (`install_faults`)
        self._rank = 0
        self._prompt = ""
        self.load_seconds = time.perf_counter() - t0
        log.info("pipeline loaded family=%s mode=%s device=%s components=%s seconds=%.2f", self.facts.family,
                 mode, self.device, self.component_bytes, self.load_seconds)

    @property
    def report(self) -> Any:
        return self.model.report

    def stats(self) -> RankStats:
        return RankStats.of(self.model.stats(), self.model.platform.memory_peak(self.device))

    def gather_only(self, gen: Generation, calls: int | None = None) -> None:
        """Idle rank in a partial wave: the gathers of every transformer call `gen` implies (or of
        the last `calls` of them: what a rank whose request failed still owes its shard group)."""
        for _ in range(self.adapter.transformer_calls(gen) if calls is None else calls):
            self.model.gather_only(1)
            self.tick()

    def order_intact(self) -> bool:
        """Whether the wave's gather order still holds (`OffloadedModel.order_intact`)."""
        return self.model.order_intact()

    # -- test-only fault injection (dlo.engine.serving.faults; never installed in production) ------
    def install_faults(self, plan: Any, rank: int) -> None:
        """Wrap the phases a request goes through so `plan` can fail one of them (tests only)."""
        self._faults, self._rank = plan, rank
        pipe = self.pipe

        def wrap(obj: Any, name: str, phase: str) -> None:
            real = getattr(obj, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._fault(phase)
                return real(*args, **kwargs)

            setattr(obj, name, wrapper)

        wrap(pipe, "encode_prompt", "encode")
        wrap(pipe.scheduler, "set_timesteps", "setup")
        wrap(pipe.vae, "decode", "decode")
        blocks = [b for name in self.adapter.block_lists for b in getattr(self.model.module, name)]
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
        with torch.inference_mode():
            out = self.pipe(**self._call_kwargs(gen), callback_on_step_end=on_step)
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

    def close(self) -> None:
        """Remove the progress hooks and release the transformer's weights."""
        self.hooks.remove()
        self.model.close()
