"""A model folder's files, listed with a bounded walk.

Owns: `walk_files` (the files below a folder, optionally by suffix: an explicit stack, no symlinked
folder followed, an unreadable subfolder skipped as `Path.rglob` skips it) and `FolderTooDeep` (a
tree deeper than `MAX_DEPTH` levels: no model folder is; a diffusers pipeline is two).
Must never: recurse on the Python stack (how deep `rglob` gets depends on the interpreter's
recursion limit, which importing torch raises: the same folder would scan in one process and fail
in another), follow a symlinked folder (a loop), or import torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

MAX_DEPTH = 32  # folder levels below a model folder (an HF cache snapshot is four)


class FolderTooDeep(Exception):
    """A folder tree deeper than `MAX_DEPTH` levels (a scan reports it as `scan_error`)."""


def walk_files(root: Path, suffixes: tuple[str, ...] | None = None, max_depth: int = MAX_DEPTH) -> Iterator[Path]:
    """Every file (or link to one) below `root` whose name ends with one of `suffixes` (all without);
    raises `FolderTooDeep` on reaching a folder more than `max_depth` levels down."""
    stack = [(Path(root), 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except PermissionError:
            continue
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                if depth + 1 > max_depth:
                    raise FolderTooDeep(f"{root}: a folder tree deeper than {max_depth} levels ({entry.path})")
                stack.append((Path(entry.path), depth + 1))
            elif suffixes is None or entry.name.endswith(suffixes):
                yield Path(entry.path)
