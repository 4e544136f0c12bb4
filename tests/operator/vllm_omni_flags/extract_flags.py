"""Extract the command-line flags of `vllm serve --omni` from the released wheels, without importing
them (vllm-omni's parser imports vllm, which imports torch and CUDA kernels).

    python tests/operator/vllm_omni_flags/extract_flags.py VLLM_OMNI_WHEEL VLLM_WHEEL > flags.json

(e.g. after `pip download vllm-omni==0.30.0 vllm==0.30.0 --no-deps`). The wheels are read as zip
files and the sources parsed with `ast`:
- every string literal starting with `--` in an `add_argument(...)` call of vllm-omni's serve
  command and engine arguments, and of vLLM's engine arguments and its serve parser;
- vLLM's frontend arguments, which vLLM generates from dataclass fields (`port` -> `--port`);
- the vLLM flags vllm-omni refuses under `--omni` (its `prohibited_with_omni` table).
Each flag is recorded with whether it takes a value (store_true/store_false/boolean flags do not).
`tests/operator/test_vllm_omni_flags.py` checks the operator's command lines against the output.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

OMNI_SOURCES = ("vllm_omni/entrypoints/cli/serve.py", "vllm_omni/engine/arg_utils.py")
VLLM_SOURCES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/launchers/cli_args.py")
FRONTEND_CLASSES = ("BaseFrontendArgs", "FrontendArgs")
NO_VALUE_ACTIONS = {"store_true", "store_false", "BooleanOptionalAction", "count"}


def _version(wheel: Path) -> str:
    return re.match(r"[^-]+-([^-]+)-", wheel.name).group(1)  # type: ignore[union-attr]


def _action(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "action":
            if isinstance(kw.value, ast.Constant):
                return str(kw.value.value)
            if isinstance(kw.value, ast.Attribute):
                return kw.value.attr
    return None


def _add_argument_flags(tree: ast.AST) -> dict[str, bool]:
    """flag -> takes a value, for every add_argument call with literal flags."""
    flags: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            takes_value = _action(node) not in NO_VALUE_ACTIONS
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    flags[arg.value] = takes_value
    return flags


def _dataclass_flags(tree: ast.AST, classes: tuple[str, ...]) -> dict[str, bool]:
    """vLLM's `get_kwargs`: one `--field-name` per annotated field; booleans take no value."""
    flags: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    annotation = ast.unparse(item.annotation)
                    name = "--" + item.target.id.replace("_", "-")
                    flags[name] = annotation != "bool"
    return flags


def _prohibited_with_omni(tree: ast.AST) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "prohibited_with_omni":
            return sorted(v.value for v in node.value.values if isinstance(v, ast.Constant))  # type: ignore[union-attr]
    raise ValueError("vllm-omni's serve command has no prohibited_with_omni table any more: review the extract")


def extract(omni_wheel: Path, vllm_wheel: Path) -> dict:
    flags: dict[str, bool] = {}
    with zipfile.ZipFile(vllm_wheel) as z:
        for name in VLLM_SOURCES:
            tree = ast.parse(z.read(name))
            flags.update(_add_argument_flags(tree))
            flags.update(_dataclass_flags(tree, FRONTEND_CLASSES))
    with zipfile.ZipFile(omni_wheel) as z:
        trees = {name: ast.parse(z.read(name)) for name in OMNI_SOURCES}
    for tree in trees.values():
        flags.update(_add_argument_flags(tree))
    return {
        "vllm-omni": _version(omni_wheel),
        "vllm": _version(vllm_wheel),
        "command": "vllm serve MODEL --omni ...",
        "prohibited_with_omni": _prohibited_with_omni(trees["vllm_omni/entrypoints/cli/serve.py"]),
        "flags": dict(sorted(flags.items())),
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    json.dump(extract(Path(sys.argv[1]), Path(sys.argv[2])), sys.stdout, indent=1)
    sys.stdout.write("\n")
