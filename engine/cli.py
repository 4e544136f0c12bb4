"""Subcommands owned by the engine: `serve`, `make-tiny-model`, `make-random-model`, `make-random-lora`,
`quantize`, `demo`, `calibrate`.

Each subcommand's implementation module is imported only when that subcommand runs.

Owns: the map from subcommand to module (`add_arguments(parser)`, `main(args)`).
Must never: import torch or a subcommand's module before that subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> module exposing `add_arguments(parser)` and `main(args) -> int`
_MODULES = {
    "make-tiny-model": "dlo.engine.families.tiny",
    "make-random-model": "dlo.engine.random_model",
    "make-random-lora": "dlo.engine.random_lora",
    "quantize": "dlo.engine.fp8_folder",
    "serve": "dlo.engine.serving.cli",
    "demo": "dlo.engine.serving.demo",
    "calibrate": "dlo.engine.calibrate",
}


def run(command: str, argv: list[str]) -> int:
    try:
        module = importlib.import_module(_MODULES[command])
    except ModuleNotFoundError as e:
        if e.name == _MODULES[command]:
            print(f"dlo {command}: not available yet in this build", file=sys.stderr)
            return 2
        raise
    from dlo.cli.args import Parser

    # One-line errors and exit 2 for bad values, as every `dlo` subcommand (CONTRACTS.md section 2).
    parser = Parser(
        prog=f"dlo {command}",
        description=module.__doc__.strip().splitlines()[0] if module.__doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(argv)) or 0)
