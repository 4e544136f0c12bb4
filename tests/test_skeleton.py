"""The repository skeleton: namespace mapping, the dispatcher, and import hygiene."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_py(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_operator_folder_does_not_shadow_stdlib_operator():
    assert not (ROOT / "operator" / "__init__.py").exists()
    # from the repository root, `import operator` must still be the standard library
    out = run_py("import operator; print(hasattr(operator, 'itemgetter'), operator.__file__)")
    ok, path = out.split(" ", 1)
    assert ok == "True"
    assert not path.startswith(str(ROOT / "operator"))


def test_parts_map_into_dlo_namespace():
    out = run_py(
        "import dlo.engine, dlo.agent, dlo.cli, dlo.operator.cli as oc;"
        "print(dlo.engine.__file__, dlo.agent.__file__, oc.__file__)"
    )
    eng, agent, op = out.split()
    assert eng.endswith("engine/__init__.py")
    assert agent.endswith("agent/__init__.py")
    assert op.endswith("operator/cli.py")


def test_import_dlo_engine_and_torch_free_modules_do_not_import_torch():
    out = run_py(
        "import sys, dlo.engine, dlo.engine.checkpoint, dlo.engine.families, dlo.engine.layout;"
        "import dlo.engine.blocks, dlo.engine.request, dlo.engine.families.tiny;"
        "import dlo.agent, dlo.cli.main; print('torch' in sys.modules)"
    )
    assert out == "False"


def imported(path: Path) -> list[tuple[str, int]]:
    """Every module name an import in `path` names, anywhere in it (top, functions, type checking),
    with its line: `import a.b` gives a.b, `from a import b` gives a and a.b."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out += [(node.module or "", node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def test_the_core_never_imports_serving():
    """The core (engine/*.py, engine/families/) imports nothing of dlo.serving, anywhere in a
    module: not at the top, not in a function, not for type checking (layers point down)."""
    offenders = []
    for path in sorted([*(ROOT / "engine").glob("*.py"), *(ROOT / "engine" / "families").glob("*.py")]):
        for name, line in imported(path):
            if name == "dlo.serving" or name.startswith("dlo.serving."):
                offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, offenders


# docs/contracts.md section 1: what of the agent the engine may import (all torch-free): the pure policy
# and profile, and the page-cache readers the start-up readahead shares with `dlo warm`
AGENT_FOR_ENGINE = {"dlo.plan.policy", "dlo.plan.profile", "dlo.pagecache.residency", "dlo.pagecache.tree", "dlo.pagecache.warm"}


def test_the_engine_imports_only_the_agent_modules_the_contract_allows():
    def allowed(name: str) -> bool:
        return name in ("dlo.agent", *AGENT_FOR_ENGINE) or any(name.startswith(m + ".") for m in AGENT_FOR_ENGINE)

    offenders = [f"{path.relative_to(ROOT)}:{line} {name}" for path in sorted((ROOT / "engine").rglob("*.py"))
                 for name, line in imported(path) if name.startswith("dlo.agent") and not allowed(name)]
    assert not offenders, offenders
    # and none of them brings torch with it
    assert run_py(f"import sys; import {', '.join(sorted(AGENT_FOR_ENGINE))}; print('torch' in sys.modules)") == "False"


def test_dispatcher_lists_every_contract_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "dlo.cli.main", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    for cmd in ["serve", "make-tiny-model", "demo", "calibrate", "agent", "warm", "plan", "operator", "crd"]:
        assert f"  {cmd} " in out


def test_unknown_subcommand_exits_2():
    proc = subprocess.run([sys.executable, "-m", "dlo.cli.main", "frobnicate"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown command" in proc.stderr
