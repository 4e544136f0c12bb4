"""`dlo plan`: memory and time estimates per mode, and the mode the policy chooses.

Owns: the arguments of `dlo plan` (every count, ratio and path checked up front: bad input is one
line on stderr and exit 2), reading the node (`--profile`, strict keys, else this machine), the
device budget (`--max-device-memory`, parsed as `dlo serve` parses it) and the model (`--model`
folder or byte counts; a pipeline folder adds its text encoders, VAE and the largest request its
limits accept, from `dlo.plan.memory_model`), the table (mode names never cut, at 80 columns or
piped) and the exit codes: 0 with a choice, 1 only when no mode fits, 2 for bad input.
Must never: import torch, or compute an estimate itself (dlo.plan.policy does, with
`require_bandwidth=False`: memory and fit are answered without a bandwidth, the time is n/a).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from dlo.cli.args import (
    UNITS,
    Parser,
    byte_size,
    existing_dir,
    existing_file,
    fail,
    non_negative_int,
    non_negative_seconds,
    positive_int,
)

if TYPE_CHECKING:
    from dlo.plan.deployment import DeploymentPlan
    from dlo.plan.limits import Limits
    from dlo.plan.policy import ModeEstimate
    from dlo.plan.profile import NodeProfile
    from dlo.plan.facts import ModelFacts
    from dlo.plan.memory_model import PipelineMemory

MAX_RANKS = 1024  # ranks on one node: more is no deployment (and overflows the time model)


def _ranks(text: str) -> int:
    value = positive_int(text)
    if value > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RANKS} ranks on one node (got {value})")
    return value


def plan_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dlo plan",
        description=(
            "Estimate host memory, device memory and time per block for each mode (allgather, "
            "rank-local, resident) and print the mode the policy chooses, with its reason. The node "
            "is --profile FILE (a NodeProfile JSON, e.g. the agent's /profile), else this machine. "
            "Memory and fit need no bandwidth: without an H2D bandwidth (a machine without "
            "accelerators, or a profile without one) the time per block is n/a and the reason says "
            "why. Exits 0 with a choice, 1 when no mode fits (the table is still printed), 2 on bad "
            "input."
        ),
        epilog=(
            "examples:\n  dlo plan --model /models/wan2.1-14b --dp 8 --tokens 32760\n"
            "  dlo plan --model-bytes 60000000000 --max-block-bytes 1200000000 --dp 8 "
            "--block-compute-seconds 0.012 --profile node.json --json\n" + UNITS
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=existing_dir, metavar="MODEL_DIR",
                     help="a diffusers pipeline or transformer folder")
    src.add_argument("--model-bytes", type=positive_int, metavar="B",
                     help="transformer weight bytes (with --max-block-bytes)")
    p.add_argument("--max-block-bytes", type=positive_int, metavar="b",
                   help="largest block's bytes (with --model-bytes)")
    p.add_argument("--blocks", type=non_negative_int, default=0,
                   help="number of blocks (informational, with --model-bytes)")
    p.add_argument("--dp", type=_ranks, default=None,
                   help=f"data-parallel ranks on the node (default: device count, or 1; at most {MAX_RANKS})")
    p.add_argument("--sp", type=_ranks, default=1, help="sequence-parallel degree (default 1)")
    p.add_argument("--max-device-memory", type=byte_size, default=None, metavar="BYTES",
                   help="the device budget per rank, as `dlo serve --max-device-memory` takes it (an integer, or "
                        "24GiB, 24GB): plan for a smaller device; default: the device's memory (or the profile's "
                        "accelerator.budget_bytes)")
    p.add_argument("--limits", type=existing_file, default=None, metavar="FILE",
                   help="with a pipeline folder: `dlo serve`'s request limits (JSON or YAML); the device peak "
                        "counts the largest request they accept (default: dlo serve's default limits)")
    p.add_argument("--max-size", type=positive_int, default=None,
                   help="with a pipeline folder: override max_width and max_height, as `dlo serve --max-size`")
    work = p.add_mutually_exclusive_group()
    work.add_argument("--block-compute-seconds", type=non_negative_seconds, metavar="T",
                      help="measured compute time of one block")
    work.add_argument("--tokens", type=positive_int, metavar="T",
                      help="tokens per rank (estimates compute from the device rate)")
    p.add_argument("--host-memory-bytes", type=positive_int, metavar="H", help="override the profile's host RAM")
    p.add_argument("--host-headroom-bytes", type=non_negative_int, default=0,
                   help="host RAM to keep free (default 0)")
    p.add_argument("--profile", type=existing_file, metavar="FILE",
                   help="NodeProfile JSON (default: detect this machine); unknown keys are errors")
    p.add_argument("--calibration", type=existing_file, metavar="FILE", help="a `dlo calibrate` fragment to apply")
    p.add_argument("--json", action="store_true",
                   help='print {"choice": {...}, "modes": {...}} (docs/contracts.md section 7)')
    return p


def run_plan(argv: list[str]) -> int:
    parser = plan_parser()
    args = parser.parse_args(argv)
    from dlo.agent.topology import local_profile
    from dlo.plan.budget import DeviceBudgetError
    from dlo.plan.deployment import PlanAsk, Workload, device_of, plan
    from dlo.plan.policy import PolicyError, device_budget
    from dlo.plan.profile import CalibrationFragment, NodeProfile, apply_calibration, parse_file

    if args.model_bytes is not None and args.max_block_bytes is None:
        parser.error("--model-bytes needs --max-block-bytes")
    if args.model is not None and args.max_block_bytes is not None:
        parser.error("--max-block-bytes goes with --model-bytes (--model reads it from the folder)")
    if args.model_bytes is not None and args.max_block_bytes > args.model_bytes:
        parser.error(f"--max-block-bytes ({args.max_block_bytes}) is larger than --model-bytes ({args.model_bytes})")
    if (args.dp or 1) * args.sp > MAX_RANKS:
        parser.error(f"--dp x --sp is {(args.dp or 1) * args.sp} ranks; at most {MAX_RANKS} on one node")
    try:
        model = _plan_model(args)
        pipeline, limits = _plan_pipeline(args)
        if args.profile is not None:
            profile = parse_file(NodeProfile, args.profile.read_text(), str(args.profile))
        else:
            profile = local_profile()
        if args.calibration is not None:
            fragment = parse_file(CalibrationFragment, args.calibration.read_text(), str(args.calibration))
            profile = apply_calibration(profile, fragment)
        if args.host_memory_bytes is not None:
            profile = profile.model_copy(update={"host_memory_bytes": args.host_memory_bytes})
    except (OSError, ValueError) as e:  # ProfileError, CheckpointError: one-line messages
        return fail("dlo plan", e)
    except KeyError as e:  # a model class without a DLO family
        return fail("dlo plan", e.args[0] if e.args else e)
    if args.host_headroom_bytes >= profile.host_memory_bytes:
        return fail("dlo plan", f"--host-headroom-bytes ({args.host_headroom_bytes}) leaves nothing of the "
                     f"host's {profile.host_memory_bytes} bytes of memory")
    dp = args.dp if args.dp is not None else max(1, profile.accelerator.count)
    if dp * args.sp > MAX_RANKS:
        return fail("dlo plan", f"{dp * args.sp} ranks (the profile's device count x --sp); at most {MAX_RANKS}")
    if args.max_device_memory is not None and not profile.accelerator.memory_bytes:
        return fail("dlo plan", "--max-device-memory needs a node with accelerators (this one has none; give "
                    "--profile FILE of one)")
    ask = PlanAsk(dp=dp, sp=args.sp, mode="auto", device=device_of(profile),
                  max_device_memory=args.max_device_memory or 0, resident_blocks="auto",
                  workload=Workload(tokens_per_rank=args.tokens, block_compute_seconds=args.block_compute_seconds,
                                    host_headroom_bytes=args.host_headroom_bytes, require_bandwidth=False))
    try:
        if pipeline is not None and args.limits is None and args.max_size is None and ask.device != "cpu":
            chosen, pipeline = _derived(args, ask, profile, limits)  # as `dlo serve` with no limits given
        else:
            chosen = plan(ask, profile=profile, transformer=model, pipeline=pipeline, limits=limits)
    except DeviceBudgetError as e:
        budget = None if not profile.accelerator.memory_bytes else device_budget(
            profile, args.max_device_memory, pipeline.context_bytes if pipeline else 0)
        message = str(e).removeprefix("--mode auto: ")
        if args.json:
            print(json.dumps({"choice": None, "error": message, "device_budget_bytes": budget, "plan": None,
                              "modes": {k: v.model_dump() for k, v in e.estimates.items()}}, indent=1))
        else:
            _print_plan_table(e.estimates, model, profile, dp * args.sp, budget, pipeline)
            print(f"dlo plan: {message}", file=sys.stderr)
        return 1
    except PolicyError as e:  # inputs that describe no deployment
        return fail("dlo plan", e)
    if args.json:
        print(json.dumps(plan_json(chosen), indent=1))
    else:
        tiled = dataclasses.replace(pipeline, tile_above_pixels=chosen.vae_tile_above_pixels) if pipeline else None
        _print_plan_table(chosen.estimates, model, profile, dp * args.sp, chosen.budget_bytes, tiled)
        from rich.console import Console

        if chosen.reasons and chosen.reasons[0].startswith("limits derived"):
            print(chosen.reasons[0])
        reason = chosen.mode_reason.removeprefix("policy: ")
        Console().print(f"[bold]choice: {chosen.mode}[/bold] - {reason}", markup=True, highlight=False)
    return 0


def _derived(args: argparse.Namespace, ask: Any, profile: Any, limits: Any) -> tuple[DeploymentPlan, PipelineMemory]:
    """The plan `dlo serve` makes of a pipeline folder with no limits given (`plan_folder`: the
    limits derived from the budget, with the table's figures: no device is measured here), and the
    pipeline's memory at the limits it chose."""
    from dlo.plan.budget import deployment_memory
    from dlo.plan.deployment import plan_folder

    chosen = plan_folder(args.model, ask, profile=profile, limits=limits, derive_limits=True)
    return chosen, deployment_memory(args.model, chosen.limits or limits, cfg_pairs=ask.pairs_counted)


def plan_json(chosen: DeploymentPlan) -> dict:
    """The `dlo plan --json` document: the policy's choice, device budget and estimates per mode
    (`Decision.plan_json`), and the whole deployment plan (`DeploymentPlan.to_dict`)."""
    assert chosen.decision is not None  # dlo plan asks for auto
    return {**chosen.decision.plan_json(), "plan": chosen.to_dict()}


def _plan_model(args: argparse.Namespace) -> ModelFacts:
    from dlo.plan.facts import ModelFacts

    if args.model is not None:
        from dlo.plan.folder import describe

        return describe(args.model)
    return ModelFacts(bytes=args.model_bytes, largest_block_bytes=args.max_block_bytes, blocks=args.blocks)


def _plan_pipeline(args: argparse.Namespace) -> tuple[PipelineMemory | None, Limits | None]:
    """A pipeline folder's memory at its limits, and the limits (None, None for a transformer folder
    or byte counts)."""
    from dlo.plan.folder import pipeline_facts

    try:
        if args.model is None:
            raise ValueError("no folder")
        pipeline_facts(args.model)
    except ValueError:  # a transformer folder, or byte counts: the transformer alone
        if args.limits is not None or args.max_size is not None:
            raise ValueError("--limits and --max-size need --model PIPELINE_DIR (a diffusers pipeline folder)") from None
        return None, None
    from dlo.plan.budget import deployment_memory
    from dlo.plan.deployment import PlanAsk
    from dlo.plan.limits import Limits

    try:
        limits = Limits.load(args.limits, max_width=args.max_size, max_height=args.max_size)
    except Exception as e:  # pydantic's ValidationError, YAML and JSON errors: one line naming the file
        raise ValueError(f"--limits {args.limits}: {e}") from None
    # as `dlo serve` runs by default: CFG pairs where the family pairs at sp 1 (counted in rank-local mode)
    return deployment_memory(args.model, limits, cfg_pairs=PlanAsk(sp=args.sp).pairs_counted), limits


def _print_plan_table(estimates: dict[str, ModeEstimate], model: ModelFacts, profile: NodeProfile, g: int,
                      budget: int | None = None, pipeline: PipelineMemory | None = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    from dlo.plan.facts import MODE_KEYS, mode_of_key

    def gb(n: int) -> str:
        return f"{n / 1e9:,.1f}"

    # the figures in GB, or in MB or kB where a model is too small to show in GB (a tiny test model)
    figures = [model.bytes, *(e.cold_start_peak_bytes or 0 for e in estimates.values())]
    unit, scale = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6)) if max(figures) >= s / 10), ("kB", 1e3))

    def size(n: int) -> str:
        return f"{n / scale:,.1f}"

    title = (
        f"model {size(model.bytes)} {unit} (page cache in every mode), largest block "
        f"{size(model.largest_block_bytes)} {unit}; {g} ranks; "
        f"host {gb(profile.host_memory_bytes)} GB, "
        + (f"device {gb(profile.accelerator.memory_bytes)} GB" if profile.accelerator.memory_bytes else "no device")
        + (f", budget {gb(budget)} GB" if budget is not None and budget != profile.accelerator.memory_bytes else "")
    )
    # No vertical rules and the units in the headers: the table fits 80 columns (a pipe, a log,
    # a small terminal) without cutting anything.
    t = Table(box=box.SIMPLE_HEAD)
    # The mode is never cut (`rank-loc…`): its column keeps its width whatever the console's.
    t.add_column("mode", justify="left", no_wrap=True, min_width=max(len(mode_of_key(k)) for k in MODE_KEYS))
    # the page cache is the model in every mode: in the title, not a column
    for col in (f"pinned\nhost {unit}", f"cold-start\npeak {unit}", f"device\nweights {unit}",
                f"device\npeak {unit}", "fits", "time per\nblock ms"):
        t.add_column(col, justify="right")
    for name, e in estimates.items():
        t.add_row(
            mode_of_key(name), size(e.pinned_host_bytes), size(e.cold_start_peak_bytes),  # type: ignore[arg-type]
            size(e.device_weight_bytes), "n/a" if e.device_peak_bytes is None else size(e.device_peak_bytes),
            "yes" if e.fits else "no", "n/a" if e.block_seconds is None else f"{e.block_seconds * 1e3:.2f}",
        )
    console = Console(highlight=False)
    widest = Measurement.get(console, console.options.update_width(10_000), t).maximum
    if widest > console.width:  # a narrower console: let long lines wrap rather than cut a number
        console = Console(highlight=False, width=widest)
    console.print(title, markup=False)
    console.print(t)
    no_device = budget is None and not profile.accelerator.memory_bytes and all(
        e.device_peak_bytes is None for e in estimates.values())
    for note in (_why_no_time(profile, g), budget is not None and _why_no_peak(estimates, pipeline),
                 no_device and "device peak n/a: the node has no accelerator (the ranks run on the host); give "
                               "--profile FILE of a GPU node to see the device figures."):
        if note:
            console.print(note, markup=False)


def _why_no_peak(estimates: dict[str, ModeEstimate], pipeline: PipelineMemory | None) -> str | None:
    """Why the device peak is n/a (its device fit then keeps 15% of the budget for the rest)."""
    if any(e.device_peak_bytes is not None for e in estimates.values()):
        return None
    from dlo.plan.policy import DEVICE_RESERVE_RATIO

    why = ("give --model PIPELINE_DIR to count the text encoders, VAE and requests" if pipeline is None
           else pipeline.rank("rank-local").unmeasured)
    return (f"device peak n/a: {why}; the device fit keeps {DEVICE_RESERVE_RATIO:.0%} of the budget for "
            "activations instead.")


def _why_no_time(profile: NodeProfile, g: int) -> str | None:
    """Why a time is n/a because a bandwidth is unknown (None: every time is known or explained)."""
    if profile.h2d_bandwidth_bps <= 0:
        what = "no accelerator on the node" if profile.accelerator.vendor == "none" else "none measured or given"
        return (f"time per block n/a: the profile has no H2D bandwidth ({what}); memory and fit need none. "
                "Give --profile FILE or --calibration FILE (`dlo calibrate`) to compare times.")
    host_ranks = profile.accelerator.vendor == "none" or profile.accelerator.memory_bytes == 0
    if host_ranks and g > 1 and profile.interconnect.collective_bandwidth_bps <= 0:
        return ("time per block n/a for allgather: the profile has no collective bandwidth between host "
                "ranks. Give --calibration FILE (`dlo calibrate`) to compare times.")
    return None
