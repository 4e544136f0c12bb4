"""The dlo.agent package: never imports torch; policy and profile stay free of I/O libraries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import write_wan_folder

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "cli", "collector", "memory", "modelcheck", "node", "plan_cli", "pods", "policy", "profile", "residency", "server",
    "topology", "warm",
]


def loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


def test_no_agent_module_imports_torch() -> None:
    mods = loaded_after("import " + ", ".join(f"dlo.agent.{m}" for m in MODULES))
    assert {f"dlo.agent.{m}" for m in MODULES} <= mods
    assert "torch" not in mods


def test_reading_model_facts_and_building_a_profile_stays_torch_free(tmp_path: Path) -> None:
    write_wan_folder(tmp_path / "models" / "m")
    root = str(tmp_path / "models")
    mods = loaded_after(
        "from pathlib import Path\n"
        "from dlo.agent.memory import ProcFS\n"
        "from dlo.agent.topology import NO_DEVICES, build_profile, model_folders\n"
        f"models = model_folders(Path({root!r}))\n"
        "p = build_profile('n', NO_DEVICES, proc=ProcFS(Path('/proc')), models=models)\n"
        "assert 'm' in p.models"
    )
    assert "torch" not in mods and "dlo.engine.families" in mods


def test_policy_and_profile_load_no_io_libraries() -> None:
    mods = loaded_after("import dlo.agent.policy, dlo.agent.profile")
    assert not {"torch", "kubernetes", "prometheus_client", "urllib.request", "subprocess"} & mods


def test_the_shared_argument_rules_load_only_the_standard_library() -> None:
    mods = loaded_after("import dlo.cli.args")
    assert not {"torch", "pydantic", "rich", "kubernetes", "prometheus_client"} & mods
