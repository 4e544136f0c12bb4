"""Run a subcommand whose module exposes `add_arguments(parser)` and `main(args) -> int`.

Owns: `run_module`, the one way a part's `cli.run` starts such a subcommand: the module imported
only then, its parser with one-line errors and exit 2 (`dlo.cli.args.Parser`), defaults in the help.
Must never: import a subcommand's module before that subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def run_module(command: str, module_name: str, argv: list[str]) -> int:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"dlo {command}: not available yet in this build", file=sys.stderr)
            return 2
        raise
    from dlo.cli.args import Parser

    parser = Parser(
        prog=f"dlo {command}",
        description=module.__doc__.strip().splitlines()[0] if module.__doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(argv)) or 0)
