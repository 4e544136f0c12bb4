"""Subcommands owned by the engine: `make-tiny-model`, `make-random-model`, `make-random-lora`,
`quantize`, `fuse-lora`, `calibrate`.

Each subcommand's implementation module is imported only when that subcommand runs.

Owns: the map from subcommand to module (`add_arguments(parser)`, `main(args)`).
Must never: import torch or a subcommand's module before that subcommand runs.
"""

from __future__ import annotations

# command -> module exposing `add_arguments(parser)` and `main(args) -> int`
_MODULES = {
    "make-tiny-model": "dlo.engine.families.tiny",
    "make-random-model": "dlo.engine.random_model",
    "make-random-lora": "dlo.engine.random_lora",
    "quantize": "dlo.engine.fp8_folder",
    "fuse-lora": "dlo.engine.fuse_lora",
    "calibrate": "dlo.engine.calibrate",
}


def run(command: str, argv: list[str]) -> int:
    from dlo.cli.modules import run_module

    return run_module(command, _MODULES[command], argv)
