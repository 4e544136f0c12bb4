"""`spec.pod` and `spec.lora` of a DLODeployment: what a platform team sets on the engine pods beyond
the engine (identity, registry credentials, runtime, labels, annotations, extra volumes) and the
LoRA adapters `dlo serve --lora-dir` loads.

Owns: `EnginePodSpec` and `LoraSource` (a claim, a node folder or a URI fetched onto the nodes as
the model's is), typed with the Kubernetes schemas of `LocalObjectReference`,
`Volume` and `VolumeMount` (`k8s_schemas`), the names and paths the operator keeps for itself, and
their rules (Python and CEL, the same).
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from dlo.delivery.uri import FetchKind, parse_uri
from dlo.operator.k8s_schemas import cel_rules, kubernetes_field
from dlo.operator.model_spec import FetchedSource, ModelSecretRef, endpoint_field, secret_ref_field, uri_field
from dlo.operator.names import (API_KEYS_MOUNT, COMPONENT, INSTANCE, LORA_KEY_ANNOTATION, LORA_MOUNT, MANAGED_BY,
                                MODE_ANNOTATION, MODEL_KEY_ANNOTATION, MODEL_MOUNT, PART_OF, TEMPLATE_HASH, VIDEO_MOUNT)
from dlo.operator.spec_base import SpecModel as _Model

# The engine pod's own volumes and mount points: extra ones may not take them.
OWN_VOLUMES = ("model", "model-cache", "shm", "tmp", "videos", "lora", "api-keys")
OWN_MOUNTS = (MODEL_MOUNT, "/dev/shm", "/tmp", VIDEO_MOUNT, LORA_MOUNT, API_KEYS_MOUNT)
OWN_LABELS = (PART_OF, COMPONENT, INSTANCE, MANAGED_BY)
OWN_ANNOTATIONS = (TEMPLATE_HASH, MODE_ANNOTATION, MODEL_KEY_ANNOTATION, LORA_KEY_ANNOTATION)
MAX_ITEMS = 32
MAX_KEYS = 64


def _quoted(items: tuple[str, ...]) -> str:
    return ", ".join(f"'{i}'" for i in items)


_VOLUME_NAME_RULE = (f"!(self.name in [{_quoted(OWN_VOLUMES)}])",
                     f"pod.volumes: the names {', '.join(OWN_VOLUMES)} are the operator's own")
_MOUNT_PATH_RULE = (
    f"![{_quoted(OWN_MOUNTS)}].exists(p, self.mountPath == p || self.mountPath.startsWith(p + '/'))",
    f"pod.volumeMounts: {', '.join(OWN_MOUNTS)} (and below) are the operator's own mount points",
)
_MOUNTS_NAME_VOLUMES_RULE = (
    "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == m.name))",
    "pod.volumeMounts must name volumes of pod.volumes",
)
_LABELS_RULE = (" && ".join(f"!('{k}' in self)" for k in OWN_LABELS),
                f"pod.labels: {', '.join(OWN_LABELS)} are the operator's own (its selectors)")
_ANNOTATIONS_RULE = (" && ".join(f"!('{k}' in self)" for k in OWN_ANNOTATIONS),
                     f"pod.annotations: {', '.join(OWN_ANNOTATIONS)} are the operator's own")


class EnginePodSpec(_Model):
    """The engine pods' settings beyond the engine: merged into the pod template (a change rolls the
    pods). `placement.priorityClassName` is the priority."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_MOUNTS_NAME_VOLUMES_RULE))

    labels: dict[str, str] = Field(
        default_factory=dict, description="labels of the engine pods (e.g. Kueue's queue name, Istio's "
        "sidecar.istio.io/inject); not the operator's selector labels",
        json_schema_extra={"maxProperties": MAX_KEYS, **cel_rules(_LABELS_RULE)})
    annotations: dict[str, str] = Field(
        default_factory=dict, description="annotations of the engine pods; not the operator's dlo.dev/ ones",
        json_schema_extra={"maxProperties": MAX_KEYS, **cel_rules(_ANNOTATIONS_RULE)})
    service_account_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="ServiceAccount of the engine pods (and of the fetch Jobs): IRSA, Workload Identity; "
        "default: the namespace's default")
    automount_service_account_token: bool = Field(
        False, description="mount the service account's API token (the engine needs none; an identity "
        "webhook that projects its own token does not either)")
    image_pull_secrets: kubernetes_field(  # type: ignore[valid-type]
        "LocalObjectReference", many=True, max_items=MAX_ITEMS, name_max_length=253,
        description="Secrets to pull the engine (and fetch) images with (core/v1 LocalObjectReference)",
    ) = Field(default_factory=list)
    runtime_class_name: str | None = Field(
        None, min_length=1, max_length=253, description="RuntimeClass of the engine pods, e.g. nvidia")
    volumes: kubernetes_field(  # type: ignore[valid-type]
        "Volume", many=True, max_items=MAX_ITEMS, name_max_length=63, item_rules=(_VOLUME_NAME_RULE,),
        described_levels=1,
        description="extra volumes of the engine pods (core/v1 Volume): certificates, credentials, caches",
    ) = Field(default_factory=list)
    volume_mounts: kubernetes_field(  # type: ignore[valid-type]
        "VolumeMount", many=True, max_items=MAX_ITEMS, name_max_length=63, max_lengths={"mountPath": 4096},
        item_rules=(_MOUNT_PATH_RULE,),
        description="mounts of pod.volumes in the engine container (core/v1 VolumeMount)",
    ) = Field(default_factory=list)

    def identity(self) -> dict[str, Any]:
        """The pod spec's service account, token mount and image pull Secrets: the engine pods' and
        the fetch Jobs' alike."""
        out: dict[str, Any] = {"automountServiceAccountToken": self.automount_service_account_token}
        if self.service_account_name:
            out["serviceAccountName"] = self.service_account_name
        if self.image_pull_secrets:
            out["imagePullSecrets"] = [dict(s) for s in self.image_pull_secrets]
        return out

    @model_validator(mode="after")
    def _own_names_stay_the_operators(self) -> EnginePodSpec:
        broken = []
        if set(self.labels) & set(OWN_LABELS):
            broken.append(_LABELS_RULE[1])
        if set(self.annotations) & set(OWN_ANNOTATIONS):
            broken.append(_ANNOTATIONS_RULE[1])
        if any(v.get("name") in OWN_VOLUMES for v in self.volumes):
            broken.append(_VOLUME_NAME_RULE[1])
        if any(m.get("mountPath") == p or str(m.get("mountPath", "")).startswith(p + "/")
               for m in self.volume_mounts for p in OWN_MOUNTS):
            broken.append(_MOUNT_PATH_RULE[1])
        if {m.get("name") for m in self.volume_mounts} - {v.get("name") for v in self.volumes}:
            broken.append(_MOUNTS_NAME_VOLUMES_RULE[1])
        if broken:
            raise ValueError("; ".join(broken))
        return self


_LORA_SOURCE_RULE = (
    "(has(self.path) ? 1 : 0) + (has(self.claimName) ? 1 : 0) + (has(self.uri) ? 1 : 0) == 1",
    "set exactly one of lora.path (hostPath), lora.claimName (PersistentVolumeClaim) and lora.uri "
    "(s3://bucket/prefix or hf://org/name[@revision], fetched onto the nodes)",
)
_LORA_URI_ONLY_RULE = (
    "has(self.uri) || (!has(self.secretRef) && !has(self.endpoint))",
    "lora.secretRef and lora.endpoint are for lora.uri only",
)
_LORA_SUBPATH_RULE = ("!has(self.subPath) || has(self.claimName)", "lora.subPath is for lora.claimName only")


class LoraSource(FetchedSource):
    """LoRA adapters the engine loads at start (`dlo serve --lora-dir`): a folder of NAME.safetensors
    files or NAME/ folders, mounted read-only at /lora; requests choose one by name. A `uri` is
    fetched onto the nodes as the model's is (`dlo fetch --kind lora`), into the cache's `.lora`
    folder."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_LORA_SOURCE_RULE, _LORA_URI_ONLY_RULE,
                                                          _LORA_SUBPATH_RULE))
    fetch_kind: ClassVar[FetchKind] = "lora"
    what: ClassVar[str] = "the adapters "

    path: str | None = Field(None, min_length=1, description="hostPath of the adapters' folder on every node")
    claim_name: str | None = Field(None, min_length=1, description="PersistentVolumeClaim holding the adapters")
    sub_path: str | None = Field(None, min_length=1, description="folder of the adapters inside the claim")
    uri: str | None = uri_field(
        "s3://bucket/prefix or hf://org/name[@revision] of the adapters' folder: fetched into each node's cache by "
        "a fetch Job (dlo fetch --kind lora), and the pods placed on nodes that hold it")
    secret_ref: ModelSecretRef | None = secret_ref_field("lora.uri", "the adapters' store")
    endpoint: str | None = endpoint_field("lora.uri")

    @model_validator(mode="after")
    def _one_source(self) -> LoraSource:
        broken = []
        if [self.path, self.claim_name, self.uri].count(None) != 2:
            broken.append(_LORA_SOURCE_RULE[1])
        if self.uri is None and (self.secret_ref is not None or self.endpoint is not None):
            broken.append(_LORA_URI_ONLY_RULE[1])
        if self.sub_path is not None and self.claim_name is None:
            broken.append(_LORA_SUBPATH_RULE[1])
        if broken:
            raise ValueError("; ".join(broken))
        if self.uri is not None:
            parse_uri(self.uri)  # the schema's pattern is coarser than the parser (a SourceRefused is a ValueError)
        return self
