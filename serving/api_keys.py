"""The API keys `dlo serve` accepts, read once at start: one key, or named keys (tenants).

Owns: where keys come from and what a key and a name must be. One key: `--api-key-file F` (UTF-8
text, white space around it ignored) or `DLO_API_KEY` (`read_api_key`). Named keys: `--api-keys
PATH` (`read_api_keys`), either a folder holding one file per key whose file name is the key's name
(what a Kubernetes Secret mounted as a volume gives: its `..data` links and other dot-names are
skipped) or a file of `name: key` lines (`#` comments and blank lines ignored). A key is printable
ASCII without spaces (clients send it in an HTTP header: any other key could never match); a name is
a DNS label (lowercase letters, digits, '-', at most 63: it becomes a metric label and a job's
owner); at most `MAX_KEYS` names, each with its own key. Every refusal is one line naming the flag
and the file (`ApiKeyError`).
Must never: put a key in a message, a log line or anything but the digests the server compares
(`dlo.serving.tenants`), take a key from the command line, or hang on a special file (FIFOs are
refused unread: `dlo.engine.checkpoint.open_regular`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from dlo.cli.args import DNS_LABEL, DNS_LABEL_RULE
from dlo.engine.checkpoint import open_regular

NAME = re.compile(DNS_LABEL)
MAX_KEYS = 256  # names are a metric label: their number stays small
MAX_FILE_BYTES = 1 << 20
DEFAULT_TENANT = "default"  # the name of the one key of --api-key-file or DLO_API_KEY


class ApiKeyError(ValueError):
    """Keys that cannot be used: one line naming the flag and the file, never the key."""


def _text(path: Path, where: str, limit: int = MAX_FILE_BYTES) -> str:
    """A regular file's UTF-8 text (a FIFO or a folder refused unread), at most `limit` bytes."""
    try:
        with open_regular(path) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ApiKeyError(f"{where}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ApiKeyError(f"{where}: larger than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiKeyError(f"{where}: not UTF-8 text (byte {e.start})") from None


def check_key(key: str, where: str) -> str:
    """`key` unless it is empty or holds a character a header cannot carry (named, not the key)."""
    if not key:
        raise ApiKeyError(f"{where} is empty")
    bad = next((c for c in key if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise ApiKeyError(f"{where}: the key holds {bad!r}; a key must be printable ASCII without spaces (clients "
                          "send it in an HTTP header, where any other character never matches)")
    return key


def check_name(name: str, where: str, *, quoted: bool = True) -> str:
    """`name` unless it is no DNS label; `quoted=False` where a mistyped line could hold a key."""
    if not NAME.match(name):
        what = f"{name[:80]!r} is not a key name" if quoted else "the name before ':' is not a key name"
        raise ApiKeyError(f"{where}: {what} ({DNS_LABEL_RULE})")
    return name


def read_api_key(path: Path | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The one key of `--api-key-file` or else `DLO_API_KEY` (None: neither)."""
    if path is not None:
        return check_key(_text(path, f"--api-key-file {path}").strip(), f"--api-key-file {path}")
    key = environ.get("DLO_API_KEY") or ""
    return check_key(key, "DLO_API_KEY") if key else None


def read_api_keys(path: Path) -> dict[str, str]:
    """`--api-keys PATH`: name -> key, from a folder of one file per key or a file of `name: key`
    lines; every name valid, every key its own, at least one and at most `MAX_KEYS`."""
    where = f"--api-keys {path}"
    keys = _from_folder(path, where) if path.is_dir() else _from_lines(path, where)
    if not keys:
        raise ApiKeyError(f"{where} holds no keys (a folder of files named by the key's name, or 'name: key' lines)")
    if len(keys) > MAX_KEYS:
        raise ApiKeyError(f"{where} holds {len(keys)} keys; at most {MAX_KEYS} (each name is a metric label)")
    seen: dict[str, str] = {}
    for name, key in keys.items():
        if key in seen:
            raise ApiKeyError(f"{where}: {seen[key]!r} and {name!r} have the same key; give each name its own key")
        seen[key] = name
    return keys


def _from_folder(folder: Path, where: str) -> dict[str, str]:
    """One file per key (a mounted Secret): its name is the key's name; dot-names are skipped."""
    try:
        names = sorted(entry for entry in os.listdir(folder) if not entry.startswith("."))
    except OSError as e:
        raise ApiKeyError(f"{where}: {e.strerror or e}") from None
    if len(names) > MAX_KEYS:
        raise ApiKeyError(f"{where} holds {len(names)} files; at most {MAX_KEYS} keys")
    keys = {}
    for name in names:
        check_name(name, where)
        keys[name] = check_key(_text(folder / name, f"{where}/{name}").strip(), f"{where}/{name}")
    return keys


def _from_lines(path: Path, where: str) -> dict[str, str]:
    """`name: key` lines (`#` comments and blank lines ignored); a name given twice is refused."""
    keys: dict[str, str] = {}
    for number, line in enumerate(_text(path, where).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, key = line.partition(":")
        at = f"{where} line {number}"
        if not colon:
            raise ApiKeyError(f"{at}: expected 'name: key'")
        name = check_name(name.strip(), at, quoted=False)
        if name in keys:
            raise ApiKeyError(f"{at}: the name {name!r} is given twice")
        keys[name] = check_key(key.strip(), f"{at} (key of {name!r})")
    return keys
