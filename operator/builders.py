"""Pure builders: a DLODeployment spec (and its resolved mode) -> the Kubernetes objects it owns.

Owns: the StatefulSet (one engine pod per node, `dlo warm` init container, `dlo serve` or
`vllm serve` engine container), the headless and client Services, the PodDisruptionBudget and the
optional PodMonitor/ServiceMonitor; the labels that tie them together and the pod-template hash the
operator uses to find pods still running an old template.
Must never: call the API server, read the clock or the environment: same input, same output.
Owner references are added by the handlers (they need the live object's uid).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from dlo.engine.facts import Mode
from dlo.operator.models import API_KEY_ENV, DLODeploymentSpec
from dlo.operator.models import DEFAULT_IMAGE, VLLM_API_KEY_ENV

PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "app.kubernetes.io/managed-by"
TEMPLATE_HASH = "dlo.dev/template-hash"
MODE_ANNOTATION = "dlo.dev/mode"
MODEL_MOUNT = "/model"
VIDEO_MOUNT = "/var/lib/dlo/videos"  # finished video jobs: an emptyDir, so they outlive a container restart
HTTP_PORT_NAME = "http"
STATEFULSET_STRATEGIES = ("OnDelete", "RollingUpdate")  # the only values apps/v1 accepts
NON_ROOT_UID = 10001


@dataclass(frozen=True)
class Owner:
    """The DLODeployment the objects belong to."""

    name: str
    namespace: str


def selector_labels(name: str) -> dict[str, str]:
    return {PART_OF: "dlo", COMPONENT: "engine", INSTANCE: name}


def labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), MANAGED_BY: "dlo-operator"}


def selector_string(name: str) -> str:
    """`status.selector` for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def _meta(owner: Owner, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": {**labels(owner.name), **(extra_labels or {})}}


def headless_service_name(name: str) -> str:
    return f"{name}-headless"


def service_url(owner: Owner, spec: DLODeploymentSpec) -> str:
    """The client Service's URL inside the cluster (`status.url`)."""
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.service.port}"


def engine_image(spec: DLODeploymentSpec) -> str:
    """The engine image; the handlers fill the operator's default in first (`with_default_image`)."""
    return spec.engine.image or DEFAULT_IMAGE


def engine_command(spec: DLODeploymentSpec, mode: Mode) -> list[str]:
    """The engine container's command line."""
    dp = str(spec.devices_per_node)
    port = str(spec.service.port)
    # The model id clients use: the model folder's name, not the mount point.
    name = ["--served-model-name", spec.model.folder_name]
    if spec.engine.kind == "vllm-omni":
        # vllm-omni refuses vLLM's --data-parallel-size under --omni: a diffusion model's ranks are
        # --num-gpus (data parallel without sequence parallelism). Flags checked against its parser
        # in tests/operator/test_vllm_omni_flags.py. The API key comes as VLLM_API_KEY (env).
        cmd = ["vllm", "serve", MODEL_MOUNT, "--omni", "--num-gpus", dp, "--port", port, *name]
        if mode != "resident":
            cmd.insert(4, "--enable-distributed-layerwise-offload")
        if mode == "rank-local":
            cmd.append("--dlo-no-use-allgather")
    else:
        cmd = ["dlo", "serve", MODEL_MOUNT, "--dp", str(spec.dp), "--mode", mode, "--device", spec.engine.device]
        if spec.sp > 1:  # dp x sp = devicesPerNode
            cmd[5:5] = ["--sp", str(spec.sp)]
        cmd += ["--host", "0.0.0.0", "--port", port, *name, "--video-dir", VIDEO_MOUNT]
        cmd += ["--shutdown-grace", str(spec.engine.shutdown_grace_seconds), *spec.engine.engine_switches()]
    return cmd + list(spec.engine.args)


# Beyond the engine's own drain (`--shutdown-grace`): its ranks' teardown and exit.
TERMINATION_SLACK_S = 5
VLLM_OMNI_TERMINATION_GRACE_S = 60


def termination_grace_seconds(spec: DLODeploymentSpec) -> int:
    """The pod's terminationGracePeriodSeconds: dlo drains for `shutdownGraceSeconds`, then exits;
    Kubernetes' SIGKILL comes only after that and the teardown."""
    if spec.engine.kind == "vllm-omni":
        return VLLM_OMNI_TERMINATION_GRACE_S
    return spec.engine.shutdown_grace_seconds + TERMINATION_SLACK_S


def warm_command(spec: DLODeploymentSpec) -> list[str]:
    return ["dlo", "warm", MODEL_MOUNT, "--threshold", f"{spec.warmer.threshold:g}"]


def _container_security(ipc_lock: bool) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if ipc_lock:
        caps["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": caps,
    }


def _model_volume(spec: DLODeploymentSpec) -> dict[str, Any]:
    if spec.model.path is not None:
        return {"name": "model", "hostPath": {"path": spec.model.path, "type": "Directory"}}
    return {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}


def _model_mount(spec: DLODeploymentSpec) -> dict[str, Any]:
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if spec.model.claim_name is not None and spec.model.sub_path:
        mount["subPath"] = spec.model.sub_path
    return mount


def shm_size(spec: DLODeploymentSpec) -> str:
    """/dev/shm for the ranks' collectives and tensor hand-offs: 1Gi per rank unless set."""
    return spec.engine.shm_size or f"{spec.devices_per_node}Gi"


def _resources(spec: DLODeploymentSpec) -> dict[str, Any]:
    resources = json.loads(json.dumps(spec.engine.resources))
    if spec.engine.device != "cpu":
        limits = resources.setdefault("limits", {})
        limits[spec.accelerator_resource] = spec.devices_per_node
        requests = resources.get("requests")
        if requests is not None:
            requests[spec.accelerator_resource] = spec.devices_per_node
    return resources


def peer_url_template(owner: Owner, spec: DLODeploymentSpec) -> str:
    """How one engine pod reaches another through the headless Service (`{pod}`: the pod's name);
    `dlo serve` forwards a video request for a job of another pod there."""
    return f"http://{{pod}}.{headless_service_name(owner.name)}.{owner.namespace}.svc:{spec.service.port}"


def _env(owner: Owner, spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "DLO_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "DLO_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if spec.engine.kind != "vllm-omni":
        env.append({"name": "DLO_PEER_URL_TEMPLATE", "value": peer_url_template(owner, spec)})
    if spec.engine.api_key_secret is not None:
        ref = spec.engine.api_key_secret
        key_env = VLLM_API_KEY_ENV if spec.engine.kind == "vllm-omni" else API_KEY_ENV
        env.append({"name": key_env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env + [dict(e) for e in spec.engine.env]


def _affinity(name: str, spec: DLODeploymentSpec) -> dict[str, Any]:
    """The user's affinity plus a required anti-affinity: one engine pod per node."""
    affinity = json.loads(json.dumps(spec.placement.affinity))
    anti = affinity.setdefault("podAntiAffinity", {})
    required = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    required.append(
        {"labelSelector": {"matchLabels": selector_labels(name)}, "topologyKey": "kubernetes.io/hostname"}
    )
    return affinity


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def readiness_path(spec: DLODeploymentSpec) -> str:
    """What says the engine can serve: `dlo serve`'s /ready; vLLM serves no /ready, and its
    /v1/models needs the API key when one is set, so /health (200 once the engine is up)."""
    return "/health" if spec.engine.kind == "vllm-omni" else "/ready"


def pod_template(owner: Owner, spec: DLODeploymentSpec, mode: Mode) -> dict[str, Any]:
    """The engine pod template, annotated with its own hash (`dlo.dev/template-hash`)."""
    engine = {
        "name": "engine",
        "image": engine_image(spec),
        "imagePullPolicy": "IfNotPresent",
        "command": engine_command(spec, mode),
        "env": _env(owner, spec),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": spec.service.port, "protocol": "TCP"}],
        "readinessProbe": _probe(readiness_path(spec), 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        # Loading and gathering a large model takes minutes: liveness starts after /health answers.
        "startupProbe": _probe("/health", 10, 90),
        "resources": _resources(spec),
        "securityContext": _container_security(spec.engine.pin_memory_lock),
        "volumeMounts": [
            _model_mount(spec),
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if spec.engine.kind != "vllm-omni":
        engine["volumeMounts"].append({"name": "videos", "mountPath": VIDEO_MOUNT})
    pod_spec: dict[str, Any] = {
        "affinity": _affinity(owner.name, spec),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": NON_ROOT_UID,
            "runAsGroup": NON_ROOT_UID,
            "fsGroup": NON_ROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [engine],
        "volumes": [
            _model_volume(spec),
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(spec)}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if spec.engine.kind != "vllm-omni":
        pod_spec["volumes"].append({"name": "videos", "emptyDir": {}})
    if spec.warmer.enabled:
        pod_spec["initContainers"] = [
            {
                "name": "warm",
                "image": spec.warmer.image or engine_image(spec),
                "imagePullPolicy": "IfNotPresent",
                "command": warm_command(spec),
                "env": [{"name": "HOME", "value": "/tmp"}],
                "securityContext": _container_security(ipc_lock=False),
                "volumeMounts": [_model_mount(spec), {"name": "tmp", "mountPath": "/tmp"}],
            }
        ]
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.placement.tolerations]
    if spec.placement.priority_class_name:
        pod_spec["priorityClassName"] = spec.placement.priority_class_name
    template = {
        "metadata": {"labels": labels(owner.name), "annotations": {MODE_ANNOTATION: mode}},
        "spec": pod_spec,
    }
    template["metadata"]["annotations"][TEMPLATE_HASH] = template_hash(template)
    return template


def template_hash(template: dict[str, Any]) -> str:
    """Hash of a pod template without its own hash annotation."""
    clean = json.loads(json.dumps(template))
    clean.get("metadata", {}).get("annotations", {}).pop(TEMPLATE_HASH, None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).hexdigest()[:16]


def update_strategy(spec: DLODeploymentSpec) -> dict[str, Any]:
    """Recreate -> OnDelete (the operator deletes old pods); RollingUpdate never surges."""
    if spec.rollout.type == "Recreate":
        return {"type": "OnDelete"}
    rolling: dict[str, Any] = {"partition": 0}
    rolling["maxUnavailable"] = spec.rollout.max_unavailable if spec.rollout.max_unavailable is not None else 1
    return {"type": "RollingUpdate", "rollingUpdate": rolling}


def build_statefulset(owner: Owner, spec: DLODeploymentSpec, mode: Mode) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": headless_service_name(owner.name),
            # Pods of one deployment are independent node groups: start and replace them together.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(owner.name)},
            "updateStrategy": update_strategy(spec),
            "template": pod_template(owner, spec, mode),
        },
    }


def _service_ports(spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    return [{"name": HTTP_PORT_NAME, "port": spec.service.port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]


def build_headless_service(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, headless_service_name(owner.name), {"dlo.dev/service": "headless"}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name),
            "ports": _service_ports(spec),
        },
    }


def build_client_service(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name, {"dlo.dev/service": "client"}),
        "spec": {"type": spec.service.type, "selector": selector_labels(owner.name), "ports": _service_ports(spec)},
    }


def build_pdb(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    unavailable = spec.rollout.max_unavailable if spec.rollout.type == "RollingUpdate" else None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "maxUnavailable": unavailable if unavailable is not None else 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
        },
    }


# The target labels the dashboards and alert rules select on (charts/dlo/rules, charts/dlo/dashboards):
# the DLODeployment, the node and one job name, besides the namespace and pod every monitor adds.
# The same list as the chart's PodMonitor (charts/dlo/templates/monitoring.yaml); a test holds them
# equal, so a DLODeployment's own monitor and the chart's label its engines alike.
ENGINE_RELABELINGS: tuple[dict[str, Any], ...] = (
    {"sourceLabels": ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", INSTANCE)],
     "targetLabel": "deployment"},
    {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"},
    {"targetLabel": "job", "replacement": "dlo-engine"},
)


def build_monitor(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    endpoint = {
        "port": HTTP_PORT_NAME, "path": "/metrics", "interval": spec.monitoring.interval,
        "relabelings": [dict(r) for r in ENGINE_RELABELINGS],
    }
    body: dict[str, Any]
    if spec.monitoring.kind == "PodMonitor":
        body = {"selector": {"matchLabels": selector_labels(owner.name)}, "podMetricsEndpoints": [endpoint]}
    else:
        selector = {**selector_labels(owner.name), "dlo.dev/service": "client"}
        body = {"selector": {"matchLabels": selector}, "endpoints": [endpoint]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": spec.monitoring.kind,
        "metadata": _meta(owner, owner.name, spec.monitoring.labels),
        "spec": body,
    }


def build_all(owner: Owner, spec: DLODeploymentSpec, mode: Mode, monitor_crd_exists: bool) -> list[dict[str, Any]]:
    """Every object the operator keeps for one DLODeployment, in apply order."""
    objects = [
        build_headless_service(owner, spec),
        build_client_service(owner, spec),
        build_pdb(owner, spec),
        build_statefulset(owner, spec, mode),
    ]
    if spec.monitoring.enabled and monitor_crd_exists:
        objects.append(build_monitor(owner, spec))
    return objects
