"""What makes a folder a complete diffusers pipeline, checked on a source's listing before anything
is downloaded and on the staged files before they are published.

Owns: `SourceFile` (one file of a source: relative path, size, checksum), `index_files` (the small
JSON files the check reads), `check_pipeline` (model_index.json, each component's folder, every
`*.safetensors.index.json` and the shards it names).
Must never: do I/O itself (it reads JSON through the function it is given) or import torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dlo.delivery.errors import SourceRefused
from dlo.delivery.paths import path_under

MODEL_INDEX = "model_index.json"
WEIGHT_INDEX_SUFFIX = ".safetensors.index.json"
ChecksumKind = Literal["s3-etag", "sha256", "git-sha1", "none"]


@dataclass(frozen=True)
class SourceFile:
    """One file of a source. `checksum` is what the store vouches for: an S3 ETag (an MD5, or for a
    multipart object the MD5 of its parts' MD5s with `-N`), a SHA-256 (Hugging Face LFS files), or
    a git blob SHA-1 (Hugging Face regular files)."""

    path: str
    size: int
    checksum: str
    kind: ChecksumKind

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "checksum": self.checksum, "kind": self.kind}

    @classmethod
    def from_json(cls, path: str, data: dict[str, object]) -> SourceFile:
        return cls(path, int(data["size"]), str(data["checksum"]), data["kind"])  # type: ignore[arg-type]


def index_files(files: Iterable[SourceFile]) -> list[SourceFile]:
    """model_index.json and every `*.safetensors.index.json`: what `check_pipeline` reads."""
    return [f for f in files if f.path == MODEL_INDEX or f.path.endswith(WEIGHT_INDEX_SUFFIX)]


def components(model_index: dict[str, object]) -> list[str]:
    """The pipeline's component folders: keys of model_index.json whose value names a library and
    class (`["diffusers", "AutoencoderKLWan"]`); `null` entries are optional components left out."""
    return sorted(k for k, v in model_index.items() if not k.startswith("_") and isinstance(v, list)
                  and len(v) == 2 and all(isinstance(x, str) for x in v))


def check_pipeline(where: str, paths: Iterable[str], read_json: Callable[[str], object]) -> None:
    """Refuse (SourceRefused, exit 2) unless `paths` make a complete diffusers pipeline: a
    model_index.json, at least one file in each component folder it names, and every shard each
    `*.safetensors.index.json` maps a weight to. `read_json(path)` gives a listed JSON file."""
    present = set(paths)
    if MODEL_INDEX not in present:
        raise SourceRefused(f"{where} is not a diffusers pipeline: no {MODEL_INDEX} at its top "
                            "(point the URI at the pipeline's folder)")
    index = _json_object(where, MODEL_INDEX, read_json)
    folders = {p.split("/", 1)[0] for p in present if "/" in p}
    missing = [c for c in components(index) if c not in folders]
    if missing:
        raise SourceRefused(f"{where}: {MODEL_INDEX} names components with no files: {', '.join(missing)}")
    for name in sorted(p for p in present if p.endswith(WEIGHT_INDEX_SUFFIX)):
        weight_map = _json_object(where, name, read_json).get("weight_map")
        if not isinstance(weight_map, dict):
            raise SourceRefused(f"{where}: {name} has no weight_map")
        folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        shards = sorted({folder + str(s) for s in weight_map.values()} - present)
        if shards:
            raise SourceRefused(f"{where}: {name} maps weights to missing shards: {', '.join(shards[:5])}")


def _json_object(where: str, path: str, read_json: Callable[[str], object]) -> dict[str, object]:
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise SourceRefused(f"{where}: {path} is not readable JSON ({e})") from None
    except RecursionError:
        raise SourceRefused(f"{where}: {path} nests too deeply to be a pipeline's JSON") from None
    if not isinstance(data, dict):
        raise SourceRefused(f"{where}: {path} is not a JSON object")
    return data


def read_json_file(root: str) -> Callable[[str], object]:
    """A `read_json` over files under `root` (each listed name through `path_under`)."""
    def read(path: str) -> object:
        with open(path_under(Path(root), path), encoding="utf-8") as f:
            return json.load(f)
    return read
