"""The engine pod template: containers, volumes, placement and the annotations the operator reads back.

Owns: the `dlo serve` / `vllm serve` engine container (command, env, probes, resources), the `dlo warm`
init container (and, for `model.uri` with `placement.modelAffinity: preferred`, the `dlo fetch` init
container before it), the model volume (a hostPath, a claim, or the node's cache folder of a fetched
model), the video folder (an emptyDir or `videos.claimName`), the LoRA adapters' folder
(`spec.lora`, `--lora-dir`: a claim, a hostPath, or the node's cache folder of fetched adapters), the Secret of named API keys (`engine.apiKeys`: read-only,
`--api-keys`), what `spec.pod` adds (identity, pull Secrets, runtime class, labels, annotations,
extra volumes and mounts), the node affinity to nodes holding a fetched model (and, always
required, the fetched adapters), the
one-pod-per-node anti-affinity, and `template_hash`.
Must never: call the API server, read the clock or the environment: same input, same output.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dlo.plan.facts import Mode
from dlo.operator.fetch_builder import cache_volume, fetch_containers
from dlo.operator.models import API_KEY_ENV, DEFAULT_IMAGE, VLLM_API_KEY_ENV, DLODeploymentSpec
from dlo.operator.names import (API_KEYS_MOUNT, HTTP_PORT_NAME, LORA_KEY_ANNOTATION, LORA_MOUNT, MODE_ANNOTATION,
                                MODEL_KEY_ANNOTATION, MODEL_MOUNT, NON_ROOT_UID, TEMPLATE_HASH, VIDEO_MOUNT, BuildContext, Owner,
                                headless_service_name, labels, model_label, selector_labels)
from dlo.operator.resources import engine_resources, warmer_resources

# Beyond the engine's own drain (`--shutdown-grace`): its ranks' teardown and exit.
TERMINATION_SLACK_S = 5
VLLM_OMNI_TERMINATION_GRACE_S = 60
PREFERRED_WEIGHT = 100


def engine_image(spec: DLODeploymentSpec) -> str:
    """The engine image; the reconcile fills the operator's default in first (`with_default_image`)."""
    return spec.engine.image or DEFAULT_IMAGE


def engine_command(spec: DLODeploymentSpec, mode: Mode) -> list[str]:
    """The engine container's command line."""
    dp = str(spec.devices_per_node)
    port = str(spec.service.port)
    # The model id clients use: the model folder's (or the URI's) name, not the mount point.
    name = ["--served-model-name", spec.model.served_name]
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
        if spec.lora is not None:
            cmd += ["--lora-dir", LORA_MOUNT]
        if spec.engine.api_keys is not None:
            cmd += spec.engine.api_keys.serve_flags(API_KEYS_MOUNT)
    return cmd + list(spec.engine.args)


def termination_grace_seconds(spec: DLODeploymentSpec) -> int:
    """The pod's terminationGracePeriodSeconds: dlo drains for `shutdownGraceSeconds`, then exits;
    Kubernetes' SIGKILL comes only after that and the teardown."""
    if spec.engine.kind == "vllm-omni":
        return VLLM_OMNI_TERMINATION_GRACE_S
    return spec.engine.shutdown_grace_seconds + TERMINATION_SLACK_S


def warm_command(spec: DLODeploymentSpec) -> list[str]:
    return ["dlo", "warm", MODEL_MOUNT, "--threshold", f"{spec.warmer.threshold:g}"]


def container_security(ipc_lock: bool) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if ipc_lock:
        caps["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": caps}


def _fetches_in_pod(spec: DLODeploymentSpec) -> bool:
    """A pod that may land on a node without the model fetches it first (modelAffinity preferred)."""
    return spec.model.uri is not None and spec.placement.model_affinity == "preferred"


def model_volume(spec: DLODeploymentSpec, ctx: BuildContext) -> dict[str, Any]:
    if spec.model.uri is not None:
        if _fetches_in_pod(spec):
            return cache_volume(ctx)
        # the node holds the model (required affinity to its label): a folder that must be there
        return {"name": "model", "hostPath": {"path": spec.model.cache_folder(ctx.cache_root), "type": "Directory"}}
    if spec.model.path is not None:
        return {"name": "model", "hostPath": {"path": spec.model.path, "type": "Directory"}}
    return {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}


def model_mount(spec: DLODeploymentSpec) -> dict[str, Any]:
    if _fetches_in_pod(spec):
        return {"name": "model-cache", "mountPath": MODEL_MOUNT, "readOnly": True, "subPath": spec.model.cache_key}
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if spec.model.claim_name is not None and spec.model.sub_path:
        mount["subPath"] = spec.model.sub_path
    return mount


def lora_volume(spec: DLODeploymentSpec, ctx: BuildContext) -> list[dict[str, Any]]:
    """spec.lora's folder: a hostPath that must be there (the node's cache folder of fetched adapters,
    which the required affinity to its label guarantees), or a claim, read-only."""
    if spec.lora is None:
        return []
    if spec.lora.uri is not None:
        return [{"name": "lora", "hostPath": {"path": spec.lora.cache_folder(ctx.cache_root), "type": "Directory"}}]
    if spec.lora.path is not None:
        return [{"name": "lora", "hostPath": {"path": spec.lora.path, "type": "Directory"}}]
    return [{"name": "lora", "persistentVolumeClaim": {"claimName": spec.lora.claim_name, "readOnly": True}}]


def lora_mount(spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    if spec.lora is None:
        return []
    mount = {"name": "lora", "mountPath": LORA_MOUNT, "readOnly": True}
    return [{**mount, "subPath": spec.lora.sub_path} if spec.lora.sub_path else mount]


def api_keys_volume(spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    """engine.apiKeys' Secret, one file per key, readable by the engine's group only (fsGroup)."""
    if spec.engine.api_keys is None:
        return []
    return [{"name": "api-keys", "secret": {"secretName": spec.engine.api_keys.secret_name, "defaultMode": 0o440}}]


def api_keys_mount(spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    return [] if spec.engine.api_keys is None else [{"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True}]


def shm_size(spec: DLODeploymentSpec) -> str:
    """/dev/shm for the ranks' collectives and tensor hand-offs: 1Gi per rank unless set."""
    return spec.engine.shm_size or f"{spec.devices_per_node}Gi"


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
    """The user's affinity, the node labels of what is fetched (the model's: required, added to every
    node selector term the user gave, which the scheduler ORs, or with `modelAffinity: preferred` a
    weighted preference; the adapters': always required, whatever `modelAffinity` says), and a required
    anti-affinity: one engine pod per node."""
    affinity = json.loads(json.dumps(spec.placement.affinity))
    required_keys = [spec.lora.cache_key] if spec.lora is not None and spec.lora.cache_key else []
    if spec.model.uri is not None:
        holds = {"key": model_label(spec.model.cache_key or ""), "operator": "Exists"}
        if spec.placement.model_affinity == "required":
            required_keys.insert(0, spec.model.cache_key or "")
        else:
            affinity.setdefault("nodeAffinity", {}).setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
                {"weight": PREFERRED_WEIGHT, "preference": {"matchExpressions": [holds]}})
    if required_keys:
        node = affinity.setdefault("nodeAffinity", {})
        required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        terms = required.setdefault("nodeSelectorTerms", []) or [{}]
        for term in terms:
            term.setdefault("matchExpressions", []).extend(
                {"key": model_label(key), "operator": "Exists"} for key in required_keys)
        required["nodeSelectorTerms"] = terms
    anti = affinity.setdefault("podAntiAffinity", {})
    anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
        {"labelSelector": {"matchLabels": selector_labels(name)}, "topologyKey": "kubernetes.io/hostname"})
    return affinity


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": HTTP_PORT_NAME}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def readiness_path(spec: DLODeploymentSpec) -> str:
    """What says the engine can serve: `dlo serve`'s /ready; vLLM serves no /ready, and its
    /v1/models needs the API key when one is set, so /health (200 once the engine is up)."""
    return "/health" if spec.engine.kind == "vllm-omni" else "/ready"


def _engine_container(owner: Owner, spec: DLODeploymentSpec, mode: Mode, ctx: BuildContext) -> dict[str, Any]:
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
        "resources": engine_resources(spec, ctx.memory_bytes),
        "securityContext": container_security(spec.engine.pin_memory_lock),
        "volumeMounts": [model_mount(spec), {"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.engine.kind != "vllm-omni":
        engine["volumeMounts"].append({"name": "videos", "mountPath": VIDEO_MOUNT})
    engine["volumeMounts"] += lora_mount(spec) + api_keys_mount(spec) + [dict(m) for m in spec.pod.volume_mounts]
    return engine


def _init_containers(spec: DLODeploymentSpec, ctx: BuildContext) -> list[dict[str, Any]]:
    out = []
    if _fetches_in_pod(spec):  # the node may lack the model: fetch it (a no-op where it is complete)
        out += fetch_containers(spec, spec.model, engine_image(spec), None, ctx, None)
    if spec.warmer.enabled:
        out.append({
            "name": "warm",
            "image": spec.warmer.image or engine_image(spec),
            "imagePullPolicy": "IfNotPresent",
            "command": warm_command(spec),
            "env": [{"name": "HOME", "value": "/tmp"}],
            "resources": warmer_resources(spec),
            "securityContext": container_security(ipc_lock=False),
            "volumeMounts": [model_mount(spec), {"name": "tmp", "mountPath": "/tmp"}],
        })
    return out


def _volumes(spec: DLODeploymentSpec, ctx: BuildContext) -> list[dict[str, Any]]:
    volumes = [model_volume(spec, ctx), {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(spec)}},
               {"name": "tmp", "emptyDir": {}}]
    if spec.engine.kind != "vllm-omni":
        if spec.videos.claim_name is not None:  # shared by every pod: a finished video survives its pod
            volumes.append({"name": "videos", "persistentVolumeClaim": {"claimName": spec.videos.claim_name}})
        else:
            volumes.append({"name": "videos", "emptyDir": {}})
    return volumes + lora_volume(spec, ctx) + api_keys_volume(spec) + [dict(v) for v in spec.pod.volumes]


def pod_template(owner: Owner, spec: DLODeploymentSpec, mode: Mode, ctx: BuildContext = BuildContext()) -> dict[str, Any]:
    """The engine pod template, annotated with its own hash (`dlo.dev/template-hash`)."""
    pod_spec: dict[str, Any] = {
        "affinity": _affinity(owner.name, spec),
        **spec.pod.identity(),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
                            "fsGroup": NON_ROOT_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_engine_container(owner, spec, mode, ctx)],
        "volumes": _volumes(spec, ctx),
    }
    if init := _init_containers(spec, ctx):
        pod_spec["initContainers"] = init
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.placement.tolerations]
    if spec.placement.priority_class_name:
        pod_spec["priorityClassName"] = spec.placement.priority_class_name
    if spec.pod.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.pod.runtime_class_name
    annotations = {**spec.pod.annotations, MODE_ANNOTATION: mode}
    if spec.model.cache_key is not None:
        annotations[MODEL_KEY_ANNOTATION] = spec.model.cache_key
    if spec.lora is not None and spec.lora.cache_key is not None:
        annotations[LORA_KEY_ANNOTATION] = spec.lora.cache_key
    template = {"metadata": {"labels": {**spec.pod.labels, **labels(owner.name)}, "annotations": annotations},
                "spec": pod_spec}
    template["metadata"]["annotations"][TEMPLATE_HASH] = template_hash(template)
    return template


def template_hash(template: dict[str, Any]) -> str:
    """Hash of a pod template without its own hash annotation."""
    clean = json.loads(json.dumps(template))
    clean.get("metadata", {}).get("annotations", {}).pop(TEMPLATE_HASH, None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).hexdigest()[:16]
