"""`dlo serve --mode auto`: the engine mode for this host, from the pure `dlo.agent.policy` over a
profile built from the engine's own device facts (or a `--profile` file), and the device budget's
check of a mode given outright.

Owns: `local_profile` (this host's `NodeProfile`), `resolve_mode` (the mode and why).
Must never: import anything of `dlo.agent` but the pure `policy` and `profile` (CONTRACTS.md
section 1), or load a model (the budget is checked from the folder's facts and the memory table).
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

from dlo.engine.facts import Mode, ModeOrAuto

log = logging.getLogger(__name__)


def local_profile(device: str) -> Any:
    """This host's `NodeProfile` from the engine's own device facts (torch, NVML for NVLink) and the
    nominal bandwidths of `dlo.agent.profile`; with no accelerator (cpu) the policy budgets
    "device" weights in host RAM."""
    from dlo.agent.profile import Accelerator, Interconnect, NodeProfile, nominal_collective_bps, nominal_h2d_bps
    from dlo.engine.devices import device_facts

    f = device_facts(device)
    acc = Accelerator(vendor=f.vendor, model=f.model, count=f.count, memory_bytes=f.memory_bytes)
    h2d = nominal_h2d_bps(f.model) if f.vendor != "none" else 0
    coll = nominal_collective_bps(f.model, f.interconnect, None) if f.vendor != "none" else 0
    return NodeProfile(
        node=socket.gethostname(), accelerator=acc,
        interconnect=Interconnect(kind=f.interconnect, collective_bandwidth_bps=coll),
        h2d_bandwidth_bps=h2d, host_memory_bytes=f.host_memory_bytes,
        can_register_page_cache=f.vendor == "nvidia",  # the engine DMAs from the page cache on cuda
    )


def _profile_from_file(profile: Any, profile_path: Path) -> Any:
    """A file a person gave: a whole NodeProfile (the agent's /profile) or a `dlo calibrate`
    fragment applied to `profile`; any problem in it is an error (ProfileError)."""
    from dlo.agent.profile import CalibrationFragment, NodeProfile, apply_calibration, parse_file

    text = profile_path.read_text()
    try:
        whole = isinstance(data := json.loads(text), dict) and "version" in data
    except ValueError:
        whole = False  # parse_file says what is wrong with it
    if whole:
        return parse_file(NodeProfile, text, str(profile_path))
    return apply_calibration(profile, parse_file(CalibrationFragment, text, str(profile_path)))


def resolve_mode(mode: ModeOrAuto, model_dir: Path, dp: int, device: str, profile_path: Path | None = None,
                 sp: int = 1, *, max_device_memory: int = 0, memory: Any = None,
                 resident_blocks: int | str = 0, stream_dtype: str = "bfloat16") -> tuple[Mode, str]:
    """The engine mode and why: `--mode` as given, else the node policy (for the transformer's blocks
    streamed as `stream_dtype`), else a fixed rule. With the deployment's `memory`
    (`dlo.engine.serving.budget`) the device budget is checked: a mode that does not fit raises
    `DeviceBudgetError` (exit 2 before anything loads)."""
    if mode != "auto":
        if memory is not None and device != "cpu":
            from dlo.engine.serving.budget import check_mode, local_budget

            budget = local_budget(local_profile(device).accelerator.memory_bytes, max_device_memory, memory)
            log.info("%s", check_mode(mode, memory, budget, dp * sp, resident_blocks))
        return mode, "--mode given"
    try:
        from dlo.agent.policy import NoModeFits, PolicyError, choose_mode
    except ImportError:
        log.warning("dlo.agent.policy is not installed; using the fixed rule")
    else:
        from dlo.engine.blocks import describe

        profile = local_profile(device)
        if profile_path is not None:
            profile = _profile_from_file(profile, profile_path)
        try:
            decision = choose_mode(profile, describe(model_dir / "transformer", stream_dtype), dp, sp=sp,
                                   device_budget_bytes=max_device_memory or None, pipeline=memory)
            return decision.engine_mode, f"policy: {decision.reason}"
        except NoModeFits as e:
            from dlo.engine.serving.budget import DeviceBudgetError

            raise DeviceBudgetError(f"--mode auto: {e}") from None
        except (PolicyError, ValueError) as e:
            log.warning("mode policy gave no answer (%s); using the fixed rule", e)
    if dp * sp > 1:
        return "allgather", "fixed rule: dp x sp > 1"
    return "rank-local", "fixed rule: dp = 1"


