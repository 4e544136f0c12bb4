"""Broken model folders: whether a folder under the models root can be loaded, and if not, why.

Owns: `REASONS` (the low-cardinality `reason` label of `dlo_model_error` and of `/profile`
`model_errors`), `ModelError`, and `check_folder`, which reads only what the engine would refuse
before a single weight moves: every safetensors header (`dlo.engine.checkpoint.read_header`), each
`*.safetensors.index.json` and the shard files it names, and the transformer's `config.json`.
Must never: import torch, read tensor data (a check costs a few KB per file whatever the file's
size), or raise for a broken folder (a broken folder is an answer, not an error).

Reasons, in the order they are looked for:
- `unreadable`: a file cannot be opened or read (permissions, I/O error).
- `missing_shard`: an index names a shard file that is not there, or the transformer has no weights.
- `bad_index`: an index is not JSON with a `weight_map`, or does not match its shards.
- `truncated`: a file is shorter than its own header says (an interrupted copy or download).
- `bad_header`: a safetensors header is not valid (not JSON, bad dtype/shape/offsets, overlaps).
- `no_config`: the transformer's `config.json` is missing or not JSON.
- `bad_config`: the transformer's `config.json` is JSON but not a model config's shape (not an
  object, or `_class_name` / `architectures` of the wrong type).
- `scan_error`: the scan of the folder itself failed (a tree too deep to walk, a file that changed
  type under it, a bug): the folder is flagged so that every other folder keeps its series.
A folder whose config names a model class DLO has no family for is not broken (another engine may
serve it): it has no facts, and no error.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dlo.pagecache.tree import FolderTooDeep, walk_files
from dlo.plan.folder import INDEX_SUFFIX, MAX_HEADER_BYTES, CheckpointError, pipeline_index, read_header

Reason = Literal["unreadable", "missing_shard", "bad_index", "truncated", "bad_header", "no_config", "bad_config",
                 "scan_error"]
REASONS: tuple[Reason, ...] = ("unreadable", "missing_shard", "bad_index", "truncated", "bad_header", "no_config",
                               "bad_config", "scan_error")
# A message travels in the node annotation: keep it short.
MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class ModelError:
    """Why a model folder cannot be loaded: a reason from REASONS and a message naming the file."""

    reason: Reason
    message: str

    @classmethod
    def of(cls, reason: Reason, message: object) -> "ModelError":
        text = str(message)
        if len(text) > MAX_MESSAGE_CHARS:
            text = text[: MAX_MESSAGE_CHARS - 3] + "..."
        return cls(reason, text)


def component_root(folder: Path) -> Path:
    """The folder holding the transformer's config and weights (a pipeline's `transformer/`)."""
    if pipeline_index(folder).is_file() and (folder / "transformer").is_dir():
        return folder / "transformer"
    return folder


def is_model_folder(folder: Path) -> bool:
    """A folder holding safetensors files or an index of them (even with every shard missing)."""
    return any(walk_files(folder, (".safetensors", INDEX_SUFFIX)))


def file_error(path: Path) -> ModelError | None:
    """The first problem of one safetensors file, reading its header only."""
    try:
        read_header(path)
        return None
    except CheckpointError as e:
        if isinstance(e.__cause__, OSError):
            return ModelError.of("unreadable", e)
        return ModelError.of("truncated" if _is_truncated(path) else "bad_header", e)


def _is_truncated(path: Path) -> bool:
    """Whether the file is shorter than its own header says it is (the header itself, or the end of
    its last tensor's data); a header that cannot be parsed counts only by its length prefix."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return True
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                return False
            if 8 + header_len > size:
                return True
            raw = f.read(header_len)
        header = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(header, dict):
        return False
    ends = [
        e["data_offsets"][1] for k, e in header.items()
        if k != "__metadata__" and isinstance(e, dict) and isinstance(e.get("data_offsets"), list)
        and len(e["data_offsets"]) == 2 and type(e["data_offsets"][1]) is int
    ]
    return 8 + header_len + max(ends, default=0) > size


def _index_error(index: Path) -> ModelError | None:
    try:
        doc = json.loads(index.read_text())
    except OSError as e:
        return ModelError.of("unreadable", f"{index}: cannot read: {e.strerror or e}")
    except (ValueError, RecursionError) as e:
        return ModelError.of("bad_index", f"{index}: not JSON: {e}")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return ModelError.of("bad_index", f"{index}: needs a 'weight_map' object of tensor name -> file name")
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if not shard.is_file():
            return ModelError.of("missing_shard", f"{shard}: shard file named in {index.name} is missing")
    return None


def _config_error(root: Path) -> ModelError | None:
    config = root / "config.json"
    if not config.is_file():
        return ModelError.of("no_config", f"{config}: missing (the transformer's diffusers config)")
    try:
        doc = json.loads(config.read_text())
    except OSError as e:
        return ModelError.of("unreadable", f"{config}: cannot read: {e.strerror or e}")
    except (ValueError, RecursionError) as e:
        return ModelError.of("no_config", f"{config}: not JSON: {e}")
    return _config_shape_error(config, doc)


def _config_shape_error(config: Path, doc: object) -> ModelError | None:
    """The fields the model's class is read from must have their types (the engine's own rule)."""
    from dlo.plan.folder import class_fields_error

    if not isinstance(doc, dict):
        return ModelError.of("bad_config", f"{config}: a JSON object is expected, got {type(doc).__name__}")
    wrong = class_fields_error(doc)
    return None if wrong is None else ModelError.of("bad_config", f"{config}: {wrong}")


def scan_error(folder: Path, error: BaseException) -> ModelError:
    """The reason for a folder whose scan raised: it is flagged, the scan of the others goes on."""
    hint = " (a folder tree deeper than can be walked)" if isinstance(error, (RecursionError, FolderTooDeep)) else ""
    return ModelError.of("scan_error", f"{folder}: scanning the folder failed{hint}: {type(error).__name__}: {error}")


def check_folder(folder: Path | str) -> ModelError | None:
    """The first reason `folder` cannot be loaded, or None when every header, index and config is
    sound. The structural problems `dlo.engine.checkpoint.Checkpoint` finds across files (a key in
    two files, an index and its shards disagreeing) are the caller's: `describe` raises them."""
    folder = Path(folder)
    try:
        listed = [p for p in walk_files(folder, (".safetensors", INDEX_SUFFIX)) if p.is_file()]
        files = sorted(p for p in listed if p.name.endswith(".safetensors"))
        indexes = sorted(p for p in listed if p.name.endswith(INDEX_SUFFIX))
        for path in (*files, *indexes):
            os.stat(path)
    except OSError as e:
        return ModelError.of("unreadable", f"{folder}: cannot list: {e.strerror or e}")
    for index in indexes:
        if (err := _index_error(index)) is not None:
            return err
    for path in files:
        if (err := file_error(path)) is not None:
            return err
    root = component_root(folder)
    if not any(root.glob("*.safetensors")) and not any(root.glob(f"*{INDEX_SUFFIX}")):
        return ModelError.of("missing_shard", f"{root}: no *.safetensors files (the transformer's weights)")
    return _config_error(root)


def describe_error(folder: Path, error: CheckpointError) -> ModelError:
    """The reason for what `dlo.engine.blocks.describe` found after `check_folder` passed: the
    files disagree with each other (a key in two files, an index and its shards)."""
    root = component_root(folder)
    if isinstance(error.__cause__, OSError):
        return ModelError.of("unreadable", error)
    if any(root.glob(f"*{INDEX_SUFFIX}")):
        return ModelError.of("bad_index", error)
    return ModelError.of("bad_header", error)
