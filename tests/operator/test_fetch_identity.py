"""Fetch Jobs write the node's model cache as a non-root user: the Job (and the fetch init containers
of engine pods) as built, a deadline for the whole Job, and the cache-owner step run for real (root
limited to CAP_CHOWN by setpriv) on a cache a root fetch of an earlier version left."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest

from dlo.operator import builders
from dlo.operator.fetch_builder import (ACTIVE_DEADLINE_S, FETCH_BACKOFF_LIMIT, FETCH_DEADLINE_S, LOCK_WAIT_S,
                                        build_fetch_job)
from dlo.operator.models import parse_spec
from dlo.operator.names import CACHE_MOUNT, BuildContext, Owner
from dlo.operator.security_config import FetchIdentity

OWNER = Owner("wan", "serving")
SPEC = parse_spec({"model": {"uri": "s3://models/wan"}, "placement": {"modelAffinity": "preferred"}})


def job_pod(fetch: FetchIdentity) -> dict:
    job = build_fetch_job(OWNER, SPEC, "node-1", [], BuildContext(fetch=fetch), None, "dlo:1")
    kubernetes_validate.validate(job, "1.37.0", strict=True)
    return job


def test_the_fetch_runs_non_root_after_a_cache_owner_step_with_chown_alone():
    job = job_pod(FetchIdentity(2000, 3000, "chown"))
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 3000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    (owner,) = pod["initContainers"]
    (fetch,) = pod["containers"]
    assert owner["securityContext"] == {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                                        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}
    assert owner["volumeMounts"] == [{"name": "model-cache", "mountPath": CACHE_MOUNT}] and "env" not in owner
    assert fetch["securityContext"] == {"runAsUser": 2000, "runAsGroup": 3000, "runAsNonRoot": True,
                                        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["hostPath"]["type"] == "DirectoryOrCreate"  # the kubelet makes it root's; the step gives it away


def test_a_preset_cache_runs_nothing_as_root_and_must_exist():
    pod = job_pod(FetchIdentity(cache_ownership="preset"))["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert all(c["securityContext"]["runAsNonRoot"] for c in pod["containers"])
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache")["hostPath"]["type"] == "Directory"


def test_the_whole_job_has_a_deadline_beyond_every_try():
    job = job_pod(FetchIdentity())
    fetch = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert fetch[fetch.index("--deadline") + 1] == str(FETCH_DEADLINE_S)
    tries = FETCH_BACKOFF_LIMIT + 1
    assert job["spec"]["activeDeadlineSeconds"] == ACTIVE_DEADLINE_S > tries * (FETCH_DEADLINE_S + LOCK_WAIT_S)


def test_engine_pods_that_fetch_run_the_same_steps_before_the_warmer():
    pod = builders.build_statefulset(OWNER, SPEC, "allgather", BuildContext())["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["cache-owner", "fetch", "warm"]
    assert pod["initContainers"][1]["securityContext"]["runAsUser"] == 10001


@pytest.fixture
def node_cache():
    """A cache folder a root fetch left (root's folders and files, a link out of it), reachable by
    other users as a node's /var/lib/dlo/models is."""
    top = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(top, 0o755)
    cache = top / "models"
    (cache / "old" / "transformer").mkdir(parents=True)
    (cache / "old" / "transformer" / "weights.safetensors").write_bytes(b"x" * 100)
    outside = top / "outside"
    outside.write_text("not the cache's")
    (cache / "old" / "link").symlink_to(outside)
    yield cache
    shutil.rmtree(top)


def as_fetch_user(script: str, cache: Path) -> subprocess.CompletedProcess:
    """`script` as uid:gid 10001 (what the fetch does in the cache: make a folder, write, evict)."""
    return subprocess.run(["setpriv", "--reuid", "10001", "--regid", "10001", "--clear-groups", "--",
                           "sh", "-c", script, "sh", str(cache)], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_the_cache_owner_step_lets_the_fetch_user_write_and_evict_a_root_fetch_left(node_cache: Path):
    fetch_like = 'mkdir "$1/new" && echo data > "$1/new/f" && rm -r "$1/old"'
    assert as_fetch_user(fetch_like, node_cache).returncode != 0  # root's cache: the fetch user can do nothing
    (owner,) = job_pod(FetchIdentity())["spec"]["template"]["spec"]["initContainers"]
    argv = [str(node_cache) if a == CACHE_MOUNT else a for a in owner["command"]]
    # root with CAP_CHOWN alone, as the container's securityContext asks
    step = subprocess.run(["setpriv", "--bounding-set=-all,+chown", "--inh-caps=-all", "--no-new-privs", "--", *argv],
                          capture_output=True, text=True, timeout=30)
    assert step.returncode == 0, step.stderr
    assert os.stat(node_cache.parent / "outside").st_uid == 0  # the link was not followed
    owned = os.stat(node_cache / "old" / "transformer" / "weights.safetensors")
    assert (owned.st_uid, owned.st_gid) == (10001, 10001)
    again = subprocess.run(["setpriv", "--bounding-set=-all,+chown", "--inh-caps=-all", "--", *argv], timeout=30)
    assert again.returncode == 0
    assert os.stat(node_cache / "old" / "transformer" / "weights.safetensors").st_ctime_ns == owned.st_ctime_ns
    done = as_fetch_user(fetch_like, node_cache)
    assert done.returncode == 0, done.stderr
    assert (node_cache / "new" / "f").read_text() == "data\n" and not (node_cache / "old").exists()


def test_a_job_past_its_deadline_is_a_timeout_in_the_status():
    from dlo.operator.model_delivery import job_result

    job = job_pod(FetchIdentity())
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                                     "message": "Job was active longer than specified deadline"}]}
    assert job_result(job, []) == {"state": "failed", "reason": "timeout",
                                   "message": "Job was active longer than specified deadline"}
