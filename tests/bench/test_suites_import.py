"""Every suite `python -m bench` names imports as a package module, with no path of its own (a suite
whose module cannot be imported is found here, not on the device)."""

from __future__ import annotations

import subprocess
import sys

from bench.__main__ import SUITES, TOOLS


def test_every_suite_and_tool_module_imports() -> None:
    modules = sorted({module for module, _ in (*SUITES.values(), *TOOLS.values())})
    code = ("import importlib, sys\n"
            f"bad = []\nfor m in {modules!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(bad)); sys.exit(1 if bad else 0)")
    # a fresh interpreter from the repository root, as `python -m bench` runs: no test's sys.path
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
