"""Figures the reliability tests measure (not a test module): printed, and appended as JSON lines
to the file named by DLO_RELIABILITY_FIGURES when set (how bench/results/reliability-*.md is filled)."""

from __future__ import annotations

import json
import os


def record(kind: str, **figures: object) -> None:
    line = json.dumps({"kind": kind, **figures}, sort_keys=True)
    print(f"figures: {line}")
    path = os.environ.get("DLO_RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
