"""Warnings a DLODeployment's status carries: what works but may hurt (`status.warnings`).

Owns: `warnings` (video jobs longer than the drain, finished videos an autoscaler's scale-in would
lose, an autoscaler that was not made) and `longest_steps` (the largest num_inference_steps the engine's
limits allow, from `engine.args`).
Must never: call the API server or read the engine's limits file (it is in the engine's image).
"""

from __future__ import annotations

from dlo.operator.models import DLODeploymentSpec

DEFAULT_MAX_STEPS = 100  # dlo.plan.limits.Limits().max_steps
SMALL_MAX_STEPS = 4  # dlo.plan.limits.SMALL.max_steps


def longest_steps(args: list[str]) -> tuple[int, str]:
    """The steps a video job may run (and where that number comes from)."""
    for i, arg in enumerate(args):
        if arg.startswith("--max-steps="):
            return int(arg.split("=", 1)[1]), "--max-steps"
        if arg == "--max-steps" and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1]), "--max-steps"
    if "--small-limits" in args:
        return SMALL_MAX_STEPS, "--small-limits"
    return DEFAULT_MAX_STEPS, "the default limits (a --limits file is not read here)"


def warnings(spec: DLODeploymentSpec, autoscaler: str | None) -> list[str]:
    out = []
    grace = spec.engine.shutdown_grace_seconds
    if spec.engine.kind == "dlo" and spec.videos.seconds_per_step is not None:
        steps, source = longest_steps(spec.engine.args)
        longest = steps * spec.videos.seconds_per_step
        if longest > grace:
            out.append(f"video jobs may run {longest:.0f} s ({steps} steps from {source} x "
                       f"{spec.videos.seconds_per_step:g} s per step) but engine.shutdownGraceSeconds is {grace}: a "
                       f"scale-in or a rollout stops longer ones; raise it to at least {longest:.0f}")
    if spec.autoscaling.enabled and spec.engine.kind == "dlo" and spec.videos.claim_name is None:
        out.append("autoscaling with finished videos on each pod's emptyDir: a scale-in deletes them (polls then "
                   "answer 404); set videos.claimName to a ReadWriteMany claim")
    if spec.autoscaling.enabled and autoscaler is None:
        out.append("autoscaling.engine keda but KEDA's ScaledObject CRD is not installed: no autoscaler was made")
    return out
