"""Model URIs: `s3://bucket/prefix` and `hf://org/name[@revision]`, and their node-cache keys.

Owns: `ModelURI` (parsed, canonical), `parse_uri`, `cache_key` (the folder a URI is fetched into,
the same on every node and in the operator: a readable name plus a digest of the canonical URI,
revision and endpoint), `cache_path` (that folder under a cache root, for a pipeline or, in the
hidden `.lora` folder, for LoRA adapters: the one place a cache path is made from a URI), the fetch
kinds, and the credential variables each scheme reads.
Must never: import anything but the standard library and delivery's own stdlib-only modules (the
operator imports it), touch the network.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dlo.delivery.errors import SourceRefused
from dlo.delivery.paths import path_under

Scheme = Literal["s3", "hf"]
SCHEMES: tuple[Scheme, ...] = ("s3", "hf")
# What a fetch publishes: a diffusers pipeline, or a folder of LoRA adapters (`dlo serve --lora-dir`).
FetchKind = Literal["pipeline", "lora"]
FETCH_KINDS: tuple[FetchKind, ...] = ("pipeline", "lora")
# Adapters' folders live below the cache root in a hidden folder: the node agent, which takes every
# visible folder with safetensors files for a model, skips them, and a model's eviction never counts them.
LORA_FOLDER = ".lora"
DEFAULT_HF_REVISION = "main"
# The environment variables a fetch takes its credentials from (the SDKs read them); the operator
# maps a Secret's keys of these names into the fetch container, never anything else.
CREDENTIAL_KEYS: dict[Scheme, tuple[str, ...]] = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION"),
    "hf": ("HF_TOKEN",),
}
REQUIRED_CREDENTIAL_KEYS: dict[Scheme, tuple[str, ...]] = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    "hf": ("HF_TOKEN",),
}
# S3 bucket names (DNS-compatible); Hugging Face repo ids (org/name).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^@]*)?|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._/-]*)?)$"


@dataclass(frozen=True)
class ModelURI:
    """A parsed model URI. `path` is the S3 key prefix (no leading or trailing '/') or the Hugging
    Face repo id (`org/name`); `revision` is None for S3 (objects under a prefix are treated as
    immutable: a new model is a new prefix)."""

    scheme: Scheme
    bucket: str
    path: str
    revision: str | None = None

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return f"hf://{self.path}@{self.revision}"

    @property
    def name(self) -> str:
        """The model's name: the last part of the prefix or the repo's name (the served model id)."""
        tail = self.path.rsplit("/", 1)[-1] if self.path else self.bucket
        return tail or self.bucket


def parse_uri(text: str, revision: str | None = None) -> ModelURI:
    """`text` as a ModelURI; `revision` (`--revision`) must agree with an `@revision` in `text`.

    Raises SourceRefused (reason `invalid`, exit 2) naming what is wrong.
    """
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in SCHEMES:
        raise SourceRefused(f"{text!r} is not a model URI: use s3://bucket/prefix or hf://org/name[@revision]",
                            reason="invalid")
    if scheme == "s3":
        return _parse_s3(text, rest, revision)
    return _parse_hf(text, rest, revision)


def _parse_s3(text: str, rest: str, revision: str | None) -> ModelURI:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise SourceRefused(f"{text!r}: {bucket!r} is not an S3 bucket name", reason="invalid")
    if revision is not None or "@" in prefix:
        raise SourceRefused(f"{text!r}: S3 models have no revision: put a new model under a new prefix",
                            reason="invalid")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise SourceRefused(f"{text!r}: the prefix has an empty, '.' or '..' part", reason="invalid")
    return ModelURI("s3", bucket, prefix)


def _parse_hf(text: str, rest: str, revision: str | None) -> ModelURI:
    repo, at, inline = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_HF_PART.fullmatch(p) for p in parts):
        raise SourceRefused(f"{text!r}: {repo!r} is not a Hugging Face repo id (org/name)", reason="invalid")
    if at and revision is not None and inline != revision:
        raise SourceRefused(f"{text!r}: the URI names revision {inline!r} but --revision is {revision!r}",
                            reason="invalid")
    rev = (inline if at else revision) or DEFAULT_HF_REVISION
    if not _REVISION.fullmatch(rev) or ".." in rev:
        raise SourceRefused(f"{text!r}: {rev!r} is not a revision (a branch, tag or commit)", reason="invalid")
    return ModelURI("hf", "", repo, rev)


def model_argument(text: str) -> "str | Path":
    """An argparse type for a model argument: a URI stays text (a Path would fold its '//'), anything
    else is a folder path."""
    return text if is_uri(text) else Path(text)


def is_uri(text: str) -> bool:
    """True for text that names a scheme this module fetches (not whether it parses)."""
    return text.split("://", 1)[0] in SCHEMES and "://" in text


def cache_key(uri: ModelURI, endpoint: str | None = None) -> str:
    """The folder name a URI is fetched into: `<name>-<12 hex>`, lower-case, at most 63 characters
    (a valid label value and path part). The digest covers the canonical URI, the revision and the
    endpoint, so another revision or another store is another folder."""
    canonical = f"{uri}|{(endpoint or '').rstrip('/')}"
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9.-]+", "-", uri.name.lower())[:50].strip("-.") or "model"
    return f"{slug}-{digest}"


def cache_path(root: str | Path, uri: ModelURI, endpoint: str | None = None, kind: FetchKind = "pipeline") -> Path:
    """The folder `uri` is fetched into under the cache `root`: `<root>/<cache key>` for a pipeline,
    `<root>/.lora/<cache key>` for adapters (through `path_under`: never outside `root`)."""
    key = cache_key(uri, endpoint)
    return path_under(Path(root), f"{LORA_FOLDER}/{key}" if kind == "lora" else key)
