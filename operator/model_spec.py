"""`spec.model` of a DLODeployment: where the pipeline folder comes from (a hostPath, a
PersistentVolumeClaim, or a URI fetched onto the nodes), its credentials and facts.

Owns: `FetchedSource` (what a source fetched onto the nodes gives the fetch Jobs and the pods: its
parsed URI, cache key, folder under a cache root and fetch kind; `ModelSource` and `LoraSource` are
ones), `ModelSource` (with the one-of rule, Python and CEL), `ModelSecretRef`, `ModelFactsOverride`,
and the names a model goes by: `served_name` (the model id clients use) and `folder_name` (its
folder on a node: the key of its facts in a node profile; for a URI, its cache key).
Must never: talk to the API server, read a Secret, or import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from dlo.delivery.uri import URI_PATTERN, FetchKind, ModelURI, cache_key, cache_path, parse_uri
from dlo.plan.facts import ModelFacts
from dlo.operator.k8s_schemas import cel_rules
from dlo.operator.spec_base import SpecModel as _Model


class ModelFactsOverride(_Model):
    """`spec.model.facts`: model facts that override what node profiles report (bytes in base units).

    The user-facing form of `dlo.plan.facts.ModelFacts` (camelCase, `blocks` optional);
    `facts()` is the one conversion.
    """

    bytes: int = Field(ge=1, description="safetensors bytes of the transformer")
    largest_block_bytes: int = Field(ge=1, description="bytes of the largest block in the slot layout")
    blocks: int | None = Field(None, ge=1, description="number of blocks (optional)")

    def facts(self) -> ModelFacts:
        """The model facts the policy takes (`blocks` defaults to 1: it only informs)."""
        return ModelFacts(bytes=self.bytes, largest_block_bytes=self.largest_block_bytes, blocks=self.blocks or 1)


class ModelSecretRef(_Model):
    """A Secret in the resource's namespace holding the store's credentials under the variable names
    the SDKs read: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optional AWS_SESSION_TOKEN,
    AWS_REGION) for s3://, HF_TOKEN for hf://. Only the fetch Jobs mount it; the operator never reads it."""

    name: str = Field(min_length=1, description="name of the Secret (same namespace)")


_MODEL_SOURCE_RULE = (
    "(has(self.path) ? 1 : 0) + (has(self.claimName) ? 1 : 0) + (has(self.uri) ? 1 : 0) == 1",
    "set exactly one of model.path (hostPath), model.claimName (PersistentVolumeClaim) and model.uri "
    "(s3://bucket/prefix or hf://org/name[@revision], fetched onto the nodes)",
)
_URI_ONLY_RULE = (
    "has(self.uri) || (!has(self.secretRef) && !has(self.endpoint))",
    "model.secretRef and model.endpoint are for model.uri only",
)
ENDPOINT_PATTERN = r"^https?://[^/\s]+(/.*)?$"


def uri_field(description: str) -> Any:
    """`uri` of a fetched source: s3:// or hf://, the parser's own check after the pattern."""
    return Field(None, pattern=URI_PATTERN, description=description)


def secret_ref_field(field: str, store: str) -> Any:
    """`secretRef` of a fetched source (`field`: `model.uri` or `lora.uri`)."""
    return Field(None, description=f"credentials of {store} ({field}): a Secret the fetch Jobs mount, never inline")


def endpoint_field(field: str) -> Any:
    """`endpoint` of a fetched source (`field`: `model.uri` or `lora.uri`)."""
    return Field(None, pattern=ENDPOINT_PATTERN, description=f"an S3-compatible store's URL or a Hugging Face "
                 f"mirror ({field}); default: AWS S3 or huggingface.co")


class FetchedSource(_Model):
    """A folder a spec names by `uri` (else by a path or a claim), fetched onto the nodes by fetch
    Jobs: the model (`spec.model`) or the LoRA adapters (`spec.lora`). No fields of its own."""

    fetch_kind: ClassVar[FetchKind] = "pipeline"  # `dlo fetch --kind`
    what: ClassVar[str] = ""  # how status messages name it before its URI

    if TYPE_CHECKING:  # the subclasses' fields
        uri: str | None
        endpoint: str | None
        secret_ref: ModelSecretRef | None

    def model_uri(self) -> ModelURI | None:
        return parse_uri(self.uri) if self.uri is not None else None

    @property
    def cache_key(self) -> str | None:
        """The node-cache folder of a URI (`dlo.delivery.uri.cache_key`); None otherwise."""
        uri = self.model_uri()
        return cache_key(uri, self.endpoint) if uri is not None else None

    def cache_folder(self, root: str) -> str:
        """Where the URI is fetched under the cache `root` (`dlo.delivery.uri.cache_path`)."""
        uri = self.model_uri()
        if uri is None:
            raise ValueError("a source without a uri is not fetched")
        return str(cache_path(root, uri, self.endpoint, self.fetch_kind))


class ModelSource(FetchedSource):
    """The model to serve: a diffusers-format folder on every node (hostPath), on a
    PersistentVolumeClaim, or at a URI the operator has fetched onto the nodes; mounted read-only at
    /model."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_MODEL_SOURCE_RULE, _URI_ONLY_RULE))

    path: str | None = Field(
        None, min_length=1, description="hostPath of a diffusers-format folder, mounted read-only"
    )
    claim_name: str | None = Field(None, min_length=1, description="PersistentVolumeClaim holding the model")
    sub_path: str = Field("", description="folder of the model inside the claim (with claimName)")
    uri: str | None = uri_field(
        "s3://bucket/prefix or hf://org/name[@revision] (default revision main): fetched into each node's cache by a "
        "fetch Job, verified, and the pods placed on nodes that hold it (placement.modelAffinity)")
    secret_ref: ModelSecretRef | None = secret_ref_field("model.uri", "the store")
    endpoint: str | None = endpoint_field("model.uri")
    facts: ModelFactsOverride | None = Field(None, description="override the model facts node profiles report")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if [self.path, self.claim_name, self.uri].count(None) != 2:
            raise ValueError(_MODEL_SOURCE_RULE[1])
        if self.uri is None and (self.secret_ref is not None or self.endpoint is not None):
            raise ValueError(_URI_ONLY_RULE[1])
        if self.uri is not None:
            parse_uri(self.uri)  # the schema's pattern is coarser than the parser (a SourceRefused is a ValueError)
        return self

    @property
    def folder_name(self) -> str:
        """The model's folder on a node: the key of its facts in a node profile's `models`."""
        if self.uri is not None:
            return self.cache_key or ""
        where = self.path if self.path is not None else (self.sub_path or self.claim_name or "")
        return where.rstrip("/").rsplit("/", 1)[-1]

    @property
    def served_name(self) -> str:
        """The model id clients use: the folder's name, or the URI's model name."""
        uri = self.model_uri()
        return uri.name if uri is not None else self.folder_name
