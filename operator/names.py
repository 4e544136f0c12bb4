"""Names, labels and annotations the operator's objects carry, and what every builder is given.

Owns: the label keys and the selectors that tie a DLODeployment's objects together (engine pods:
component `engine`, fetch Jobs and their pods: component `fetch`), the annotations the operator reads
back (template hash, mode, the model and adapters a pod template runs), the node label that says a
node holds a fetched model (or adapters' folder) completely (`model.dlo.dev/<cache key>`), mount points, and `BuildContext`.
Must never: call the API server, read the clock or the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dlo.operator.security_config import FetchIdentity, NetworkPolicySettings

PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
TEMPLATE_HASH = "dlo.dev/template-hash"
MODE_ANNOTATION = "dlo.dev/mode"
MODEL_KEY_ANNOTATION = "dlo.dev/model-key"  # on pod templates and fetch Jobs: the model's cache key
MODEL_SOURCE_ANNOTATION = "dlo.dev/model-source"  # on the StatefulSet: the spec.model its pods run (JSON)
LORA_KEY_ANNOTATION = "dlo.dev/lora-key"  # on pod templates: the cache key of the fetched adapters (lora.uri)
LORA_SOURCE_ANNOTATION = "dlo.dev/lora-source"  # on the StatefulSet: the spec.lora its pods run (JSON)
FETCH_NODE_ANNOTATION = "dlo.dev/fetch-node"  # on fetch Jobs: the node they fetch onto
# on the StatefulSet: "true" while the operator keeps a NetworkPolicy for the pods (deleted once off)
NETWORK_POLICY_ANNOTATION = "dlo.dev/network-policy"
MODEL_LABEL_PREFIX = "model.dlo.dev/"  # node label `model.dlo.dev/<key>: "true"`: the node holds the model
MODEL_MOUNT = "/model"
CACHE_MOUNT = "/cache"  # the node's model cache, in fetch containers
VIDEO_MOUNT = "/var/lib/dlo/videos"  # finished video jobs: an emptyDir (or videos.claimName)
LORA_MOUNT = "/lora"  # spec.lora: the adapters' folder (`dlo serve --lora-dir`)
API_KEYS_MOUNT = "/etc/dlo/api-keys"  # engine.apiKeys: the Secret of named keys (`dlo serve --api-keys`)
HTTP_PORT_NAME = "http"
NON_ROOT_UID = 10001


@dataclass(frozen=True)
class Owner:
    """The DLODeployment the objects belong to."""

    name: str
    namespace: str


@dataclass(frozen=True)
class BuildContext:
    """What the builders need besides the spec and the mode (from the operator's configuration and
    what the reconcile found)."""

    cache_root: str = "/var/lib/dlo/models"  # node folder of fetched models
    memory_bytes: int | None = None  # the plan's per-pod host estimate (None: no facts known)
    autoscaler: Literal["keda", "hpa"] | None = None  # which autoscaling object spec.autoscaling gets
    prometheus_url: str = ""
    monitoring_release: str = ""
    network_policy: NetworkPolicySettings | None = None  # None: the operator makes no NetworkPolicy
    fetch: FetchIdentity = field(default_factory=FetchIdentity)  # as whom fetch Jobs write the cache
    log_format: str = "text"  # the operator's `--log-format`, which its fetch Jobs log in


def selector_labels(name: str, component: str = "engine") -> dict[str, str]:
    return {PART_OF: "dlo", COMPONENT: component, INSTANCE: name}


def labels(name: str, component: str = "engine") -> dict[str, str]:
    return {**selector_labels(name, component), MANAGED_BY: "dlo-operator"}


def selector_string(name: str) -> str:
    """`status.selector` for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def meta(owner: Owner, name: str, extra_labels: dict[str, str] | None = None, component: str = "engine") -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace,
            "labels": {**labels(owner.name, component), **(extra_labels or {})}}


def model_label(key: str) -> str:
    """The node label a completed fetch of the model with cache key `key` sets."""
    return MODEL_LABEL_PREFIX + key


def headless_service_name(name: str) -> str:
    return f"{name}-headless"


def service_url(owner: Owner, port: int) -> str:
    """The client Service's URL inside the cluster (`status.url`)."""
    return f"http://{owner.name}.{owner.namespace}.svc:{port}"
