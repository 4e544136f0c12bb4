"""What makes a folder a folder of LoRA adapters (`dlo fetch --kind lora`), checked on a source's
listing before anything is downloaded.

Owns: `adapter_entries` (the adapters a listing holds at its top, as `dlo serve --lora-dir` finds
them: `NAME.safetensors` files and `NAME/` folders holding a `.safetensors` file; hidden names
ignored) and `check_adapters`.
Must never: do I/O, read a tensor, or judge whether an adapter fits a model (the engine does that at
start, against the model it serves), or import torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from dlo.delivery.errors import SourceRefused

SUFFIX = ".safetensors"


def adapter_entries(paths: Iterable[str]) -> list[str]:
    """The top-level entries of `paths` that `dlo serve --lora-dir` takes as adapters, by name."""
    names = set()
    for path in paths:
        top, sep, rest = path.partition("/")
        if top.startswith("."):
            continue
        if not sep and top.endswith(SUFFIX) and len(top) > len(SUFFIX):
            names.add(top[: -len(SUFFIX)])
        elif sep and "/" not in rest and rest.endswith(SUFFIX):  # the engine looks in the folder, not below
            names.add(top)
    return sorted(names)


def check_adapters(where: str, paths: Iterable[str]) -> None:
    """Refuse (SourceRefused, exit 2) a listing with no adapter at its top."""
    listed = list(paths)
    if not adapter_entries(listed):
        raise SourceRefused(f"{where} is not a folder of LoRA adapters: no NAME.safetensors file or NAME/ folder "
                            f"holding one at its top ({len(listed)} files listed; point the URI at the adapters' "
                            "folder)")
