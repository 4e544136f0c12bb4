"""Names from outside as paths under a root: the one place delivery turns a name it did not choose
(an S3 object key below the model's prefix, a Hugging Face repo path, a manifest's file name, a
cache key beside DEST) into a file path.

Owns: `path_under` and `UnsafeName`. A name is refused (exit 2, one line naming it) when it is empty
or absolute, holds a backslash, a NUL or another control character, has an empty, '.' or '..'
segment or one longer than a file name may be, has a segment starting `.dlo-` (the fetch's own
files), or, given the names already mapped under the same root, aliases one of them: the same file
once case and Unicode forms are folded (a case-insensitive file system), or a file where another
name needs a folder.
Must never: touch the file system (a name is checked as text), or return a path outside its root.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

from dlo.delivery.errors import SourceRefused

RESERVED_PREFIX = ".dlo-"  # the fetch's own files (state, manifest, marker, stamps)
MAX_SEGMENT_BYTES = 255  # NAME_MAX of the file systems a cache lives on


class UnsafeName(SourceRefused):
    """A name that cannot be a file under its root (exit 2, reason `refused`: nothing is written)."""


def path_under(root: Path, name: str, mapped: dict[str, str] | None = None) -> Path:
    """`name` (segments separated by '/') as a path under `root`, or UnsafeName. With `mapped` (the
    names mapped under this root so far, by their folded form; filled in here) a name that aliases
    another is refused too; the same name mapped twice is the same path."""
    problem = _problem(name)
    if problem is None and mapped is not None:
        problem = _alias(name, mapped)
    path = root.joinpath(*name.split("/")) if problem is None else root
    if problem is None and not _inside(root, path):
        problem = "it leaves the folder"  # unreachable after the checks above: the last guard
    if problem is not None:
        raise UnsafeName(f"{name!r} cannot be a file under {root}: {problem}; nothing was written for it")
    return path


def _inside(root: Path, path: Path) -> bool:
    top, low = os.path.normpath(root), os.path.normpath(path)
    return low != top and os.path.commonpath([top, low]) == top


def _problem(name: str) -> str | None:
    """What makes `name` unsafe on its own, or None."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it holds a NUL or another control character"
    if "\\" in name:
        return "it holds a backslash"
    if name.startswith("/"):
        return "it is an absolute path"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return f"it has {'an empty' if not segment else 'a ' + repr(segment)} segment"
        if len(segment.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
            return f"a segment is longer than {MAX_SEGMENT_BYTES} bytes"
        if segment.startswith(RESERVED_PREFIX):
            return f"names starting with {RESERVED_PREFIX} are the fetch's own files"
    return None


def _alias(name: str, mapped: dict[str, str]) -> str | None:
    """Refuse `name` when it folds to a name mapped before or clashes with one as file and folder;
    else record it (and its folders, as `folded/`)."""
    key = unicodedata.normalize("NFC", name).casefold()
    if key in mapped:
        return None if mapped[key] == name else f"it names the same file as {mapped[key]!r}"
    if key + "/" in mapped:
        return f"it is a file where {mapped[key + '/']!r} needs a folder"
    parts = key.split("/")
    folders = ["/".join(parts[:i]) for i in range(1, len(parts))]
    clash = next((mapped[f] for f in folders if f in mapped), None)
    if clash is not None:
        return f"it needs {clash!r} to be a folder"
    mapped[key] = name
    for folder in folders:
        mapped.setdefault(folder + "/", name)
    return None
