"""The fetch of a `model.uri` onto a node: the `dlo fetch` container (a node fetch Job's, or the
engine pod's init container with `placement.modelAffinity: preferred`) and the Job.

Owns: `fetch_container`, `build_fetch_job`, `fetch_job_name`, `cache_volume`. The contract with the
fetch (docs/operator.md, "Model delivery"): the Job runs `dlo fetch URI /cache/<key> --keep K...
[--disk-budget B] [--endpoint E] --progress plain --result-file /dev/termination-log` on the node
named by its required node affinity (`matchFields metadata.name`), with the node's cache folder
(`hostPath <cacheRoot>`, DirectoryOrCreate: the fetcher creates its cache) at /cache and the
credentials from `model.secretRef` as the variables the SDKs read; it prints plain progress lines
(the operator reads the last one from the pod's log) and leaves its result as JSON in the
termination message (state, bytes, evicted keys; or reason and message). Exit 2 (not a pipeline, a
bad URI) fails the Job at once (podFailurePolicy); other failures are retried twice, resuming.
Must never: put a credential in a command line or an env value (secretKeyRef only), give the pod an
API token unless `spec.pod` asks for one, or write anywhere on the node but the cache folder.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dlo.delivery.uri import CREDENTIAL_KEYS, REQUIRED_CREDENTIAL_KEYS
from dlo.operator.model_spec import ModelSource
from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import (CACHE_MOUNT, FETCH_NODE_ANNOTATION, MODEL_KEY_ANNOTATION, BuildContext, Owner,
                                labels, meta)
from dlo.operator.resources import fetcher_resources

TERMINATION_LOG = "/dev/termination-log"
FETCH_BACKOFF_LIMIT = 2
REFUSED_EXIT_CODE = 2  # `dlo fetch`: bad input or not a pipeline; retrying cannot help


def cache_volume(ctx: BuildContext) -> dict[str, Any]:
    """The node's model cache; DirectoryOrCreate because the fetcher is the one that creates it."""
    return {"name": "model-cache", "hostPath": {"path": ctx.cache_root, "type": "DirectoryOrCreate"}}


def fetch_command(model: ModelSource, keep: list[str] | None, ctx: BuildContext, budget: int | None) -> list[str]:
    """`keep`: the cache keys pods on the node use (never evicted); None: not known, evict nothing."""
    key = model.cache_key or ""
    cmd = ["dlo", "fetch", str(model.uri), f"{CACHE_MOUNT}/{key}", "--progress", "plain",
           "--result-file", TERMINATION_LOG]
    if model.endpoint:
        cmd += ["--endpoint", model.endpoint]
    if keep is None:
        cmd.append("--no-evict")
    for other in sorted(set(keep or []) - {key}):
        cmd += ["--keep", other]
    if budget is not None:
        cmd += ["--disk-budget", str(budget)]
    return cmd


def _credentials(model: ModelSource) -> list[dict[str, Any]]:
    uri = model.model_uri()
    if model.secret_ref is None or uri is None:
        return []
    required = REQUIRED_CREDENTIAL_KEYS[uri.scheme]
    return [{"name": k, "valueFrom": {"secretKeyRef": {"name": model.secret_ref.name, "key": k,
                                                       **({} if k in required else {"optional": True})}}}
            for k in CREDENTIAL_KEYS[uri.scheme]]


def fetch_container(spec: DLODeploymentSpec, model: ModelSource, image: str, keep: list[str] | None, ctx: BuildContext,
                    budget: int | None) -> dict[str, Any]:
    """`dlo fetch` into the node cache: root (the cache folder the kubelet creates is root's) with
    every capability dropped, no privilege escalation, a read-only root file system."""
    return {
        "name": "fetch",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": fetch_command(model, keep, ctx, budget),
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
                *_credentials(model)],
        "resources": fetcher_resources(),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def fetch_job_name(owner: Owner, key: str, node: str) -> str:
    digest = hashlib.sha256(f"{key}|{node}".encode()).hexdigest()[:10]
    return f"{owner.name[:40]}-fetch-{digest}"


def build_fetch_job(owner: Owner, spec: DLODeploymentSpec, node: str, keep: list[str], ctx: BuildContext,
                    budget: int | None, image: str) -> dict[str, Any]:
    """The Job that fetches `spec.model` onto `node`."""
    key = spec.model.cache_key or ""
    job_labels = labels(owner.name, "fetch")
    annotations = {MODEL_KEY_ANNOTATION: key, FETCH_NODE_ANNOTATION: node}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **spec.pod.identity(),  # the pull Secrets of the engine image, the identity a store may trust
        "enableServiceLinks": False,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [fetch_container(spec, spec.model, image, keep, ctx, budget)],
        "volumes": [cache_volume(ctx), {"name": "tmp", "emptyDir": {}}],
    }
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.placement.tolerations]
    if spec.placement.priority_class_name:
        pod_spec["priorityClassName"] = spec.placement.priority_class_name
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**meta(owner, fetch_job_name(owner, key, node), component="fetch"), "annotations": annotations},
        "spec": {
            "backoffLimit": FETCH_BACKOFF_LIMIT,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "fetch", "operator": "In", "values": [REFUSED_EXIT_CODE]}}]},
            "template": {"metadata": {"labels": job_labels, "annotations": annotations}, "spec": pod_spec},
        },
    }
