"""Safetensors checkpoints: our own header parser, byte ranges, validation and zero-copy views.

Owns: reading a safetensors directory (one file, several files, or `*.index.json` shards), checking
every byte of metadata we rely on, and handing out read-only tensor views over ONE shared `mmap` per
file (the OS page cache: N ranks on a node cost one copy of the model); the one JSON config reader
(`read_json_config`) and the per-process parse cache (`cached_checkpoint`: a folder's headers are
parsed once per process, again only when its files change).
Must never: import torch at module import (the agent and operator use this module), copy tensor
data, or let a malformed file through as anything but `CheckpointError` naming the file and key (a
FIFO or another non-regular file named like a checkpoint, a header nested past the parser's stack,
a key given twice: refused at once, never a hang or a traceback).
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

# safetensors dtype name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})
# A header larger than this is not a real checkpoint header (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_SUFFIX = ".safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is unusable. The message names the file and, where there is one, the key."""

    def __init__(self, path: Path | str, message: str, key: str | None = None):
        self.path = str(path)
        self.key = key
        where = f"{self.path}" + (f" [{key}]" if key else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range `[start, end)` inside `path`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _fail(path: Path, message: str, key: str | None = None) -> CheckpointError:
    return CheckpointError(path, message, key)


def open_regular(path: Path, *, follow_links: bool = True) -> BinaryIO:
    """`path` opened for reading at once (O_NONBLOCK: a FIFO never blocks the open); OSError unless
    it is a regular file (a FIFO, a socket or a device named `*.safetensors` would hang a read) or,
    with `follow_links=False`, when `path` itself is a symbolic link (O_NOFOLLOW)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a special file"
            raise OSError(errno.EINVAL, f"{kind}, not a regular file: refused without reading it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is refused (safetensors refuses it too, and
    the first or the last would each be another file)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _parse_header_json(path: Path, raw: bytes) -> Any:
    """A header's JSON: CheckpointError for what is not UTF-8 JSON, repeats a key, or nests deeper
    than the parser's stack (a hostile header; a real one nests three deep)."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(path, f"header is not valid UTF-8 JSON: {e}") from e
    except RecursionError:
        raise _fail(path, "header nests too deeply to be a safetensors header") from None


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; return its tensors and metadata."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated file: {size} bytes, a safetensors file needs at least 8")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + header_len > size:
                raise _fail(path, f"header length {header_len} runs past the end of the file ({size} bytes)")
            raw = f.read(header_len)
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}") from e
    header = _parse_header_json(path, raw)
    if not isinstance(header, dict):
        raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
    data_start = 8 + header_len
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _fail(path, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _parse_entry(path, name, entry, data_start, data_len)
    _check_no_overlap(path, tensors.values())
    return tensors, metadata


def _parse_entry(path: Path, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _fail(path, "tensor entry must be an object", name)
    dtype = entry.get("dtype")
    if dtype not in DTYPE_SIZES:
        raise _fail(path, f"unknown dtype {dtype!r}", name)
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(path, f"shape must be a list of non-negative integers, got {shape!r}", name)
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
    ):
        raise _fail(path, f"data_offsets must be two integers, got {offsets!r}", name)
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise _fail(path, f"data_offsets {offsets} outside the data section of {data_len} bytes", name)
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise _fail(path, f"data_offsets span {end - begin} bytes, shape {shape} of {dtype} needs {expected}", name)
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _check_no_overlap(path: Path, tensors: Iterable[TensorInfo]) -> None:
    prev: TensorInfo | None = None
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.start):
        if prev is not None and t.start < prev.end:
            raise _fail(path, f"data overlaps tensor {prev.name!r}", t.name)
        prev = t


def read_json_config(path: Path | str) -> dict[str, Any]:
    """The one reader of a model folder's JSON configs (config.json, model_index.json): a JSON
    object, or `CheckpointError` naming the file."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            config = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"unreadable model config: {e}") from e
    except RecursionError:
        raise CheckpointError(path, "unreadable model config: it nests too deeply") from None
    if not isinstance(config, dict):
        raise CheckpointError(path, "a model config must be a JSON object")
    return config


_CACHE: dict[tuple[str, tuple], tuple[list[Path], dict[str, "TensorInfo"]]] = {}
_CACHE_MAX = 8


def _signature(root: Path) -> tuple:
    """What identifies a checkpoint's files on disk: names, sizes, modification times, inodes."""
    paths = [root] if root.is_file() else sorted(
        p for p in root.glob("*") if p.name.endswith(".safetensors") or p.name.endswith(INDEX_SUFFIX)
    ) if root.is_dir() else []
    out = []
    for p in paths:
        st = p.stat()
        out.append((p.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def cached_checkpoint(root: Path | str) -> "Checkpoint":
    """`Checkpoint(root)`, its headers parsed once per process while the folder's files stay the
    same (the validation before start-up, the policy's model facts and `dlo.engine.load` share one
    parse). The cache holds the parse only: each caller gets its own `Checkpoint` and so its own
    file mappings, which close with it - a cache that held mappings would keep every page it ever
    touched mapped in this process for good (pinning them in the page cache against eviction)."""
    path = Path(root).resolve()
    key = (str(path), _signature(path))
    parsed = _CACHE.get(key)
    if parsed is None:
        ckpt = Checkpoint(path)
        for old in [k for k in _CACHE if k[0] == key[0]]:
            del _CACHE[old]  # the files changed: the old parse is stale
        while len(_CACHE) >= _CACHE_MAX:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = (ckpt.files, ckpt.tensors)
        return ckpt
    return Checkpoint(path, parsed=parsed)


class Checkpoint:
    """A folder of safetensors files seen as one name -> tensor map.

    Accepts a folder with `*.safetensors.index.json` (its weight_map is authoritative), or one or more
    `*.safetensors` files, or a path to a single `.safetensors` file.
    """

    def __init__(self, root: Path | str, *, parsed: tuple[list[Path], dict[str, "TensorInfo"]] | None = None):
        """`parsed`: the (files, tensors) of an earlier parse of the same unchanged folder
        (`cached_checkpoint`); never mutated, so parses may share it."""
        self.root = Path(root)
        self._maps: dict[Path, mmap.mmap] = {}
        self._maps_lock = threading.Lock()  # an early-registration thread maps files too: one mapping per file
        self.files, self.tensors = parsed if parsed is not None else self._scan()

    # ---- discovery and validation -------------------------------------------------------------
    def _scan(self) -> tuple[list[Path], dict[str, TensorInfo]]:
        root = self.root
        if root.is_file():
            return [root], read_header(root)[0]
        if not root.is_dir():
            raise CheckpointError(root, "no such checkpoint file or folder")
        indexes = sorted(root.glob("*" + INDEX_SUFFIX))
        if len(indexes) > 1:
            raise CheckpointError(root, f"several index files: {[p.name for p in indexes]}")
        if indexes:
            return self._scan_index(indexes[0])
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(root, "no *.safetensors files")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(f)[0].items():
                if name in tensors:
                    raise CheckpointError(f, f"key also stored in {tensors[name].path.name}", name)
                tensors[name] = info
        return files, tensors

    def _scan_index(self, index: Path) -> tuple[list[Path], dict[str, TensorInfo]]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(index, f"unreadable index (needs a 'weight_map' object): {e}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(index, "weight_map must map tensor names to file names")
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, []).append(key)
        tensors: dict[str, TensorInfo] = {}
        files = []
        for fname, keys in sorted(by_file.items()):
            path = (index.parent / fname).resolve()
            if path.parent != index.parent.resolve():
                raise CheckpointError(index, f"shard file {fname!r} is outside the checkpoint folder", keys[0])
            if not path.is_file():
                raise CheckpointError(path, "shard file named in the index is missing", keys[0])
            found = read_header(path)[0]
            for key in keys:
                if key not in found:
                    raise CheckpointError(path, "key listed in the index is not in this file", key)
            extra = sorted(set(found) - set(keys))
            if extra:
                raise CheckpointError(path, "key in the file is not listed in the index", extra[0])
            files.append(path)
            tensors.update(found)
        return files, tensors

    def validate(self, expected: Mapping[str, tuple[tuple[int, ...], Iterable[str]]]) -> None:
        """Check names, shapes and dtypes against what the model expects.

        `expected` maps tensor name -> (shape, allowed safetensors dtypes).
        """
        missing = sorted(set(expected) - set(self.tensors))
        if missing:
            raise CheckpointError(self.root, f"missing key ({len(missing)} missing in all)", missing[0])
        unexpected = sorted(set(self.tensors) - set(expected))
        if unexpected:
            info = self.tensors[unexpected[0]]
            raise CheckpointError(info.path, f"unexpected key ({len(unexpected)} in all)", unexpected[0])
        for name, (shape, dtypes) in expected.items():
            info = self.tensors[name]
            if tuple(shape) != info.shape:
                raise CheckpointError(info.path, f"shape {list(info.shape)}, the model expects {list(shape)}", name)
            allowed = tuple(dtypes)
            if info.dtype not in allowed:
                raise CheckpointError(info.path, f"dtype {info.dtype}, the model expects {' or '.join(allowed)}", name)

    @cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # ---- zero-copy views ------------------------------------------------------------------------
    def mapping(self, path: Path) -> mmap.mmap:
        """The one read-only shared mapping of `path` in this process."""
        with self._maps_lock:
            m = self._maps.get(path)
            if m is None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                self._maps[path] = m
            return m

    def file_bytes(self, path: Path) -> "torch.Tensor":
        """The whole mapped file as a read-only uint8 tensor (no copy)."""
        import warnings

        import torch

        with warnings.catch_warnings():
            # The buffer is read-only on purpose: views are never written to.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.mapping(path), dtype=torch.uint8)

    def view(self, name: str) -> "torch.Tensor":
        """A read-only tensor over the page cache for `name` (no copy)."""
        from dlo.engine.dtypes import torch_dtype

        info = self.tensors[name]
        raw = self.file_bytes(info.path)[info.start : info.end]
        return raw.view(torch_dtype(info.dtype)).view(info.shape)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # live tensor views still export the buffer; the mapping closes with them
        self._maps.clear()
