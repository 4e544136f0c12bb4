"""Subcommands owned by the agent: `dlo agent`, `dlo warm`, `dlo plan` (issue: node agent)."""

from __future__ import annotations

import sys


def run(command: str, argv: list[str]) -> int:
    print(f"dlo {command}: arrives with the node-agent issue", file=sys.stderr)
    return 2
