"""The one error an adapter that cannot be served raises.

Owns: `AdapterError` (the message names the file; `dlo serve` prints it in one line and exits 2).
Must never: import anything but the standard library (every module of `dlo.engine.lora` raises it).
"""

from __future__ import annotations

from pathlib import Path


class AdapterError(ValueError):
    """An adapter that cannot be served as diffusers would load it; the message names the file."""

    def __init__(self, path: Path | str, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")
