"""The Wan 2.2 two-expert family (Wan2.2-T2V-A14B: `WanPipeline` with `transformer` and `transformer_2`).

Owns: recognising a two-transformer Wan folder (model_index.json names `transformer_2` and a
`boundary_ratio`), its pipeline facts (both experts stream, each through its own `dlo.engine.load`
with the same mode and shard group), and the call plan: `WanPipeline` runs the high-noise expert
`transformer` for every step whose timestep is >= boundary_ratio x num_train_timesteps and the
low-noise `transformer_2` for the rest, so an idle rank walks `transformer`'s gathers for the
high-noise calls, then `transformer_2`'s for the low-noise ones: the same collective order as a
rank that computes (the switch happens at the boundary step on every rank).
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlo.engine.checkpoint import read_json_config
from dlo.engine.families.pipelines import PipelineFacts
from dlo.engine.families.wan import WanFamily
from dlo.engine.request import Generation


class Wan22Family(WanFamily):
    name = "wan2.2"  # both experts have Wan's blocks (`WAN_BLOCKS`)
    cfg_pairs = True  # each expert pairs its own steps (`ModelPairs`; tests/engine/test_cfg_pairs.py)

    def matches(self, index: dict) -> bool:
        return (index.get("_class_name") == self.pipeline_class
                and (index.get("transformer_2") or [None])[0] is not None)

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        if index.get("boundary_ratio") is None:
            raise ValueError(f"{root}: transformer_2 without a boundary_ratio in model_index.json")
        spatial = int(vae.get("scale_factor_spatial") or 8)
        patch = transformer.get("patch_size", [1, 2, 2])
        return PipelineFacts(self.name, self.pipeline_class, spatial * int(patch[1]),
                             int(vae.get("scale_factor_temporal") or 4), 4.0, transformer["_class_name"],
                             transformers=("transformer", "transformer_2"))

    def call_plan(self, gen: Generation, pipe: Any) -> list[tuple[str, int]]:
        high = _high_noise_steps(type(pipe.scheduler), pipe.scheduler.config, pipe.config.boundary_ratio, gen.steps)
        branches = 2 if self.uses_cfg(gen) else 1
        return [("transformer", high * branches), ("transformer_2", (gen.steps - high) * branches)]

    def warmup_steps(self, model_dir: Path, steps: int) -> int:
        """The fewest steps from `steps` on whose schedule reaches the low-noise expert: with
        Wan2.2-T2V-A14B's flow shift of 12 the first step below the boundary is the third of three
        (two steps run `transformer` only), so its first call is paid before `/ready`."""
        import diffusers

        config = read_json_config(model_dir / "scheduler" / "scheduler_config.json")
        scheduler = getattr(diffusers, config["_class_name"])
        ratio = read_json_config(model_dir / "model_index.json")["boundary_ratio"]
        for n in range(steps, steps + MAX_WARMUP_STEPS):
            if 0 < _high_noise_steps(scheduler, config, ratio, n) < n:
                return n
        return steps  # no schedule this short reaches both experts: the first request pays the second's first call


# the most steps the warm-up adds to reach Wan2.2's second expert
MAX_WARMUP_STEPS = 16


def _high_noise_steps(scheduler: Any, config: Any, boundary_ratio: float, steps: int) -> int:
    """Steps of a `steps`-step request that WanPipeline runs on `transformer` (timestep >= the
    boundary): the timesteps of a fresh scheduler of that class and config, the pipeline's call."""
    sched = scheduler.from_config(config)
    sched.set_timesteps(steps, device="cpu")
    return int((sched.timesteps >= boundary_ratio * sched.config.num_train_timesteps).sum())
