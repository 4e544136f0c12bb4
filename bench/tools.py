"""The tools of `python -m bench` that are no suite: the stamp a device call's records name their
commit by.

Owns: `main(tool, argv)` for `stamp`.
Must never: measure anything.
"""

from __future__ import annotations

import argparse
import json

from bench.lib.provenance import STAMP, write_stamp


def stamp(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench stamp", description="write the commit and source digest "
                                 "of this checkout into .whl/SOURCE.json (the device's copy has no git)")
    ap.parse_args(argv)
    print(json.dumps(write_stamp(STAMP)))
    return 0


def main(tool: str, argv: list[str]) -> int:
    return {"stamp": stamp}[tool](argv)
