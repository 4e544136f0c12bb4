"""Where a `dlo serve` process's import seconds go, without a GPU or a model.

Runs, in fresh interpreters, the imports a Wan2.1 `dlo serve` process makes before it can load
(the CLI and the HTTP stack, torch, diffusers, the pipeline and model classes, transformers'
UMT5), `--repeat` times, with `-X importtime`; prints the total and the top modules by cumulative
and by self time of the last repeat (the first pays for any bytecode not yet cached), and whether
the interpreter can cache bytecode where the packages live.

    python -m bench imports [--repeat 2] [--top 25] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

IMPORTS = """
import dlo.cli.main
import dlo.serving.service, dlo.serving.server
import torch
import diffusers
from diffusers import WanPipeline, WanTransformer3DModel, AutoencoderKLWan
from transformers import UMT5EncoderModel, AutoTokenizer
"""


def bytecode_facts() -> dict:
    """Whether bytecode is cached where torch, diffusers and transformers live (found without
    importing them: an import here could write the bytecode it is asked about)."""
    out: dict = {"dont_write_bytecode": sys.flags.dont_write_bytecode,
                 "pycache_prefix": sys.pycache_prefix,
                 "env": {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}}
    for name in ("torch", "diffusers", "transformers"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            out[name] = "not installed"
            continue
        pkg = Path(list(spec.submodule_search_locations)[0])
        out[name] = {"dir": str(pkg), "py_files": sum(1 for _ in pkg.rglob("*.py")),
                     "pyc_files": sum(1 for _ in pkg.rglob("__pycache__/*.pyc")), "writable": os.access(pkg, os.W_OK)}
    return out


def optional_packages_installed() -> list[str]:
    """Which optional packages diffusers or transformers would import here because they are
    installed (the engine's `UNNEEDED_OPTIONAL_PACKAGES`, and accelerate, which the image also
    lacks); found without importing them."""
    from dlo.engine.timing import UNNEEDED_OPTIONAL_PACKAGES

    return [name for name in (*UNNEEDED_OPTIONAL_PACKAGES, "accelerate") if importlib.util.find_spec(name) is not None]


def cached(facts: dict, package: str) -> bool | None:
    """Bytecode cached for (nearly) every source file of `package` (None: not recorded)."""
    f = facts.get(package) if isinstance(facts, dict) else None
    if not isinstance(f, dict) or not f.get("py_files"):
        return None
    return f["pyc_files"] >= 0.9 * f["py_files"]


def profile_once() -> tuple[float, list[tuple[str, int, int]]]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", IMPORTS], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(r.stderr[-4000:])
    rows = []
    for line in r.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line[len("import time:"):].split("|")
        rows.append((name.rstrip()[1:], int(self_us), int(cum_us)))  # nested names are indented
    return seconds, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench imports", description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None, help="write import-profile.json here")
    args = ap.parse_args(argv)
    facts = bytecode_facts()
    runs = [profile_once() for _ in range(args.repeat)]
    _, rows = runs[-1]
    top_level = sorted((r for r in rows if not r[0].startswith(" ")), key=lambda r: -r[2])
    by_self = sorted(rows, key=lambda r: -r[1])
    rec = {"python": sys.version.split()[0], "bytecode": facts,
           "seconds_per_run": [round(s, 3) for s, _ in runs],
           "top_level_cumulative_s": {n.strip(): round(c / 1e6, 3) for n, _, c in top_level[:args.top]},
           "self_s": {n.strip(): round(s / 1e6, 3) for n, s, _ in by_self[:args.top]},
           "self_total_s": round(sum(s for _, s, _ in rows) / 1e6, 3)}
    text = json.dumps(rec, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import-profile.json").write_text(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
