"""Subcommands owned by serving: `dlo serve` (dlo.serving.serve) and `dlo demo` (dlo.serving.demo).

Owns: the map from subcommand to module. Must never: import a subcommand's module before it runs.
"""

from __future__ import annotations

_MODULES = {"serve": "dlo.serving.serve", "demo": "dlo.serving.demo"}


def run(command: str, argv: list[str]) -> int:
    from dlo.cli.modules import run_module

    return run_module(command, _MODULES[command], argv)
