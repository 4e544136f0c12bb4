"""Subcommands owned by the operator: `dlo operator run|render`, `dlo crd` (issue: operator)."""

from __future__ import annotations

import sys


def run(command: str, argv: list[str]) -> int:
    print(f"dlo {command}: arrives with the operator issue", file=sys.stderr)
    return 2
