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


def test_the_core_never_imports_serving():
    """The core (engine/*.py, engine/families/) imports nothing of dlo.engine.serving, anywhere in a
    module: not at the top, not in a function, not for type checking (layers point down)."""
    import ast

    offenders = []
    for path in sorted([*(ROOT / "engine").glob("*.py"), *(ROOT / "engine" / "families").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            names += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(n == "dlo.engine.serving" or n.startswith("dlo.engine.serving.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


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
