"""The dlo.agent, dlo.plan and dlo.pagecache packages: never import torch; policy and profile stay
free of I/O libraries; the agent never imports the engine (it reads folders through dlo.plan.folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import write_wan_folder

ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE = sorted(f"dlo.{pkg}.{f.stem}" for pkg in ("agent", "plan", "pagecache")
                    for f in (ROOT / pkg).glob("*.py") if f.stem != "__init__")


def loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


def test_no_agent_plan_or_pagecache_module_imports_torch() -> None:
    assert "dlo.plan.deployment" in TORCH_FREE and "dlo.agent.plan_cli" in TORCH_FREE
    mods = loaded_after("import " + ", ".join(TORCH_FREE))
    assert set(TORCH_FREE) <= mods
    assert "torch" not in mods


def test_no_agent_module_imports_the_engine_and_no_engine_module_the_agent() -> None:
    import ast

    def imports(pkg: str) -> set[str]:
        out = set()
        for f in (ROOT / pkg).rglob("*.py"):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, ast.ImportFrom) and n.module:
                    out.add(f"{f.relative_to(ROOT)}: {n.module}")
                elif isinstance(n, ast.Import):
                    out.update(f"{f.relative_to(ROOT)}: {a.name}" for a in n.names)
        return out

    assert not [i for i in imports("agent") if i.split(": ")[1].startswith("dlo.engine")]
    assert not [i for pkg in ("engine", "serving") for i in imports(pkg) if i.split(": ")[1].startswith("dlo.agent")]


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
    mods = loaded_after("import dlo.plan.policy, dlo.plan.profile")
    assert not {"torch", "kubernetes", "prometheus_client", "urllib.request", "subprocess"} & mods


def test_the_shared_argument_rules_load_only_the_standard_library() -> None:
    mods = loaded_after("import dlo.cli.args")
    assert not {"torch", "pydantic", "rich", "kubernetes", "prometheus_client"} & mods
