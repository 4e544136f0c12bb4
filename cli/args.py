"""The common flag rules of the `dlo` command (docs/contracts.md section 2), for every part's parsers.

Owns: `Parser`, an `argparse.ArgumentParser` whose errors are one line on stderr and exit 2 (no
usage block, never a traceback); `fail` for bad input found after parsing (same shape); and the
argument types that reject out-of-range values with a message naming the value and the range:
counts (`positive_int`, `non_negative_int`), byte sizes (`byte_size`: 25769803776, 24GiB, 24GB), seconds (`positive_seconds`, `non_negative_seconds`),
ratios 0..1 (`ratio`), ports (`port`), names (`dns_label`), paths that must exist (`existing_path`, `existing_file`,
`existing_dir`) and URLs (`http_url`).
Must never: import anything but the standard library (the operator image and `dlo agent` load it),
or change a value silently: a value out of range is an error, never clamped.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import urllib.parse
from pathlib import Path
from typing import NoReturn


UNITS = "Byte counts are integers (bytes), ratios are 0..1, times are seconds."


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `PROG: error: MESSAGE (see PROG --help)`."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def fail(prog: str, message: object) -> int:
    """Bad input found after parsing: one line `PROG: MESSAGE` on stderr; returns the exit code 2."""
    print(f"{prog}: {one_line(str(message))}", file=sys.stderr)
    return 2


def one_line(text: str) -> str:
    """`text` with its lines joined by "; " (error messages of libraries often span lines)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (ranks, threads, tokens, byte counts of something that exists)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


MAX_RANKS = 1024  # ranks of one node (dp x sp): more than any host holds devices or cores for


def rank_count(text: str) -> int:
    """A number of ranks, 1..MAX_RANKS (`--dp`, `--sp`): a 23-digit one describes no node."""
    value = positive_int(text)
    if value > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RANKS} ranks on one node (got {value})")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {value})")
    return value


def positive_seconds(text: str) -> float:
    """A duration > 0 seconds (intervals: 0 would spin)."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds (got {text})")
    return value


def non_negative_seconds(text: str) -> float:
    """A duration >= 0 seconds."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 seconds or more (got {text})")
    return value


def ratio(text: str) -> float:
    """A ratio from 0 to 1 (`0.99`, not `99`)."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a ratio from 0 to 1, like 0.99 (got {text})")
    return value


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535 (got {value})")
    return value


def new_folder(text: str) -> Path:
    """A folder to create, or an empty one (never written over)."""
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(f"{path} exists and is not an empty folder: choose a new one")
    return path


def existing_path(text: str) -> Path:
    """A file or folder that exists."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return path


def existing_file(text: str) -> Path:
    """A regular file that exists."""
    path = existing_path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a file")
    return path


def existing_dir(text: str) -> Path:
    """A folder that exists."""
    path = existing_path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a folder")
    return path


# A DNS label (RFC 1123): pod names, tenant names; no '_' or '.', so it never aliases an address or a path.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS_LABEL_RULE = "a DNS label: lowercase letters, digits and '-', at most 63, starting and ending alphanumeric"


def dns_label(text: str) -> str:
    """A DNS label (`DNS_LABEL`): a name that becomes a label or a part of an id."""
    if not re.match(DNS_LABEL, text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not {DNS_LABEL_RULE}")
    return text


def http_url(text: str) -> str:
    """An `http://` or `https://` URL with a host (and a valid port, if any)."""
    parts = urllib.parse.urlsplit(text)
    try:
        parts.port  # noqa: B018 (raises ValueError on a port out of range)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be from 0 to 65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL with a host")
    return text


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """A byte count >= 1: an integer, or a number with a unit (24GiB = 24 * 2**30, 24GB = 24 * 10**9)."""
    raw = text.strip().replace("_", "")
    num = raw.rstrip("BbKkMmGgTtIi")
    unit = raw[len(num):].lower()
    if unit not in _BYTE_UNITS or not num:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (an integer, or a number with KiB, MiB, GiB, "
                                         "TiB, KB, MB, GB or TB)")
    value = _float(num) * _BYTE_UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte (got {text})")
    return int(value)
