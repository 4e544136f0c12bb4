"""The fetch of a `model.uri` (or a `lora.uri`) onto a node: the `dlo fetch` container (a node fetch
Job's, or the engine pod's init container with `placement.modelAffinity: preferred`) and the Job.

Owns: `fetch_containers`, `build_fetch_job`, `fetch_job_name`, `cache_volume`. The contract with the
fetch (docs/operator.md, "Model delivery"): the Job runs `dlo fetch URI /cache/<key> --keep K...
[--disk-budget B] [--endpoint E] --deadline S --progress plain --result-file /dev/termination-log` (for
adapters `dlo fetch URI /cache/.lora/<key> --kind lora ...`: the folders `dlo.delivery.uri.cache_path`
gives) on
the node named by its required node affinity (`matchFields metadata.name`), with the node's cache
folder (`hostPath <cacheRoot>`) at /cache and the credentials from `model.secretRef` as the
variables the SDKs read (`lora.secretRef` for adapters); it prints plain progress lines (the operator reads the last one from the
pod's log) and leaves its result as JSON in the termination message (state, bytes, evicted keys; or
reason and message). Exit 2 (not a pipeline, a bad URI) fails the Job at once (podFailurePolicy);
other failures are retried twice, resuming; `activeDeadlineSeconds` bounds the whole Job (every try's
deadline and lock wait, and a start allowance), so a pod that never runs frees its fetch slot.
The fetch runs as the operator's `FetchIdentity` (non-root, uid:gid 10001 by default, fsGroup the
gid). The node folder must be that user's: `chown` (the default) makes the hostPath
`DirectoryOrCreate` and runs a `cache-owner` init container first, root with CAP_CHOWN alone (no
network, no credentials), that gives the folder and what is in it (a root fetch of an earlier
version left root's files there) to uid:gid, changing only what is not theirs; `preset` expects the
folder to exist as theirs (hostPath `Directory`) and runs nothing as root (docs/security.md).
Must never: put a credential in a command line or an env value (secretKeyRef only), give the pod an
API token unless `spec.pod` asks for one, run the fetch as root, or write anywhere on the node but
the cache folder.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dlo.delivery.deadline import DEFAULT_DEADLINE_S
from dlo.delivery.uri import CREDENTIAL_KEYS, REQUIRED_CREDENTIAL_KEYS
from dlo.operator.model_spec import FetchedSource
from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import (CACHE_MOUNT, FETCH_NODE_ANNOTATION, MODEL_KEY_ANNOTATION, BuildContext, Owner,
                                labels, meta)
from dlo.operator.resources import fetcher_resources

TERMINATION_LOG = "/dev/termination-log"
FETCH_BACKOFF_LIMIT = 2
REFUSED_EXIT_CODE = 2  # `dlo fetch`: bad input or not a pipeline; retrying cannot help
FETCH_DEADLINE_S = int(DEFAULT_DEADLINE_S)  # one try of `dlo fetch` ends by then (a rerun resumes)
LOCK_WAIT_S = 600  # `dlo fetch --lock-wait` (its default): another fetch into the folder ends first
START_ALLOWANCE_S = 900  # scheduling, an image pull, the cache-owner step
# The whole Job, every try included: past it the Job fails (DeadlineExceeded) and frees its slot.
ACTIVE_DEADLINE_S = (FETCH_BACKOFF_LIMIT + 1) * (FETCH_DEADLINE_S + LOCK_WAIT_S) + START_ALLOWANCE_S


def cache_volume(ctx: BuildContext) -> dict[str, Any]:
    """The node's model cache: created by the kubelet (root's, then given to the fetch user by the
    cache-owner step) with `chown`; with `preset` it must exist already, as the fetch user's."""
    kind = "Directory" if ctx.fetch.cache_ownership == "preset" else "DirectoryOrCreate"
    return {"name": "model-cache", "hostPath": {"path": ctx.cache_root, "type": kind}}


def fetch_command(model: FetchedSource, keep: list[str] | None, ctx: BuildContext, budget: int | None) -> list[str]:
    """`keep`: the cache keys pods on the node use (never evicted); None: not known, evict nothing."""
    key = model.cache_key or ""
    cmd = ["dlo", "fetch", str(model.uri), model.cache_folder(CACHE_MOUNT), "--progress", "plain",
           "--result-file", TERMINATION_LOG]
    if model.fetch_kind != "pipeline":
        cmd += ["--kind", model.fetch_kind]
    if model.endpoint:
        cmd += ["--endpoint", model.endpoint]
    if keep is None:
        cmd.append("--no-evict")
    for other in sorted(set(keep or []) - {key}):
        cmd += ["--keep", other]
    if budget is not None:
        cmd += ["--disk-budget", str(budget)]
    if ctx.log_format != "text":  # as the operator logs (its progress lines stay what the operator parses)
        cmd += ["--log-format", ctx.log_format]
    return cmd + ["--deadline", str(FETCH_DEADLINE_S)]


def _credentials(model: FetchedSource) -> list[dict[str, Any]]:
    uri = model.model_uri()
    if model.secret_ref is None or uri is None:
        return []
    required = REQUIRED_CREDENTIAL_KEYS[uri.scheme]
    return [{"name": k, "valueFrom": {"secretKeyRef": {"name": model.secret_ref.name, "key": k,
                                                       **({} if k in required else {"optional": True})}}}
            for k in CREDENTIAL_KEYS[uri.scheme]]


def _cache_owner(image: str, ctx: BuildContext) -> dict[str, Any]:
    """Root with CAP_CHOWN alone: what under the cache folder is not uid:gid's becomes theirs
    (`find ... -exec chown -h`: links are not followed; what is theirs already is left untouched)."""
    owner = ctx.fetch
    return {
        "name": "cache-owner",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["find", CACHE_MOUNT, "-xdev", "(", "!", "-user", str(owner.uid), "-o", "!", "-group",
                    str(owner.gid), ")", "-exec", "chown", "-h", f"{owner.uid}:{owner.gid}", "{}", "+"],
        "resources": fetcher_resources(),
        "securityContext": {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_MOUNT}],
    }


def fetch_containers(spec: DLODeploymentSpec, model: FetchedSource, image: str, keep: list[str] | None,
                     ctx: BuildContext, budget: int | None) -> list[dict[str, Any]]:
    """The cache-owner step (with `chown`), then `dlo fetch` into the node cache as the fetch user,
    every capability dropped, no privilege escalation, a read-only root file system."""
    fetch = _fetch_container(spec, model, image, keep, ctx, budget)
    return [_cache_owner(image, ctx), fetch] if ctx.fetch.cache_ownership == "chown" else [fetch]


def _fetch_container(spec: DLODeploymentSpec, model: FetchedSource, image: str, keep: list[str] | None,
                     ctx: BuildContext, budget: int | None) -> dict[str, Any]:
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
        "securityContext": {"runAsUser": ctx.fetch.uid, "runAsGroup": ctx.fetch.gid, "runAsNonRoot": True,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def fetch_job_name(owner: Owner, key: str, node: str) -> str:
    digest = hashlib.sha256(f"{key}|{node}".encode()).hexdigest()[:10]
    return f"{owner.name[:40]}-fetch-{digest}"


def build_fetch_job(owner: Owner, spec: DLODeploymentSpec, node: str, keep: list[str], ctx: BuildContext,
                    budget: int | None, image: str, source: FetchedSource | None = None) -> dict[str, Any]:
    """The Job that fetches `source` (default `spec.model`; `spec.lora` for adapters) onto `node`:
    one per node and source (its name is the digest of both)."""
    source = spec.model if source is None else source
    key = source.cache_key or ""
    job_labels = labels(owner.name, "fetch")
    steps = fetch_containers(spec, source, image, keep, ctx, budget)
    annotations = {MODEL_KEY_ANNOTATION: key, FETCH_NODE_ANNOTATION: node}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        **spec.pod.identity(),  # the pull Secrets of the engine image, the identity a store may trust
        "enableServiceLinks": False,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": ctx.fetch.uid, "runAsGroup": ctx.fetch.gid,
                            "fsGroup": ctx.fetch.gid, "seccompProfile": {"type": "RuntimeDefault"}},
        **({"initContainers": steps[:-1]} if len(steps) > 1 else {}),
        "containers": steps[-1:],
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
            "activeDeadlineSeconds": ACTIVE_DEADLINE_S,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "fetch", "operator": "In", "values": [REFUSED_EXIT_CODE]}}]},
            "template": {"metadata": {"labels": job_labels, "annotations": annotations}, "spec": pod_spec},
        },
    }
