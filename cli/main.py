"""`dlo` dispatcher.

Owns only the table of subcommands and which part answers each (docs/contracts.md section 2). A part's
module `dlo.<part>.cli` is imported only when one of its subcommands runs, so `dlo agent` and
`dlo operator` never import torch. Each part exposes `run(command: str, argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (owning part, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serving", "run the engine: rank processes, HTTP API, wave scheduler"),
    "make-tiny-model": ("engine", "write a small random diffusers-format pipeline (tests, demo)"),
    "make-random-model": ("engine", "write a full-size pipeline folder (real configs and shapes, random weights)"),
    "make-random-lora": ("engine", "write a LoRA adapter with random weights for a model folder (--rank R)"),
    "quantize": ("engine", "write a pipeline folder whose transformers stream FP8 weights (dlo serve --stream-dtype fp8)"),
    "fuse-lora": ("engine", "write a model folder with a LoRA adapter merged into its weights (MODEL ADAPTER[:SCALE] DST)"),
    "demo": ("serving", "the README's main job: tiny model, 2 CPU ranks, one wave, PNGs"),
    "calibrate": ("engine", "measure H2D and collective bandwidth; write a profile fragment"),
    "agent": ("agent", "node agent: /metrics, /profile, /health"),
    "warm": ("agent", "page-cache warmer for model files"),
    "plan": ("agent", "memory and time estimates per mode, and the choice"),
    "operator": ("operator", "run the operator, or render the objects for a resource"),
    "crd": ("operator", "print (or --write) the DLODeployment CRD YAML"),
    "fetch": ("delivery", "download a diffusers pipeline from S3 or Hugging Face: resumable, verified, atomic"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    rows = "\n".join(f"  {c:<{width}}  {h}" for c, (_, h) in COMMANDS.items())
    return (
        "usage: dlo <command> [options]\n\n"
        "DLO: serve Diffusion Transformers larger than one accelerator with Distributed Layerwise "
        "Offload.\n\ncommands:\n"
        f"{rows}\n\n"
        "Run `dlo <command> --help` for a command's options."
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command == "--version":
        from importlib.metadata import version

        print(version("dlo"))
        return 0
    if command not in COMMANDS:
        print(f"dlo: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    part = COMMANDS[command][0]
    module = importlib.import_module(f"dlo.{part}.cli")
    return int(module.run(command, rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
