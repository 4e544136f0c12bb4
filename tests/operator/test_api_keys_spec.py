"""`engine.apiKeys` (named keys, one tenant each): examples/dlodeployment-tenants.yaml builds engine
pods that mount the Secret read-only for the engine's group and pass `--api-keys` and
`--admin-key`, strictly valid against the Kubernetes schemas; the spec's refusals (both key sources,
vllm-omni, a name the engine would refuse) are one message each. The served result end to end:
tests/e2e/test_tenants_e2e.py."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dlo.operator import builders
from dlo.operator.builders import Owner
from dlo.operator.models import API_KEY_ENV, SpecError, parse_spec
from dlo.operator.names import API_KEYS_MOUNT

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner("wan", "serving")


def example() -> dict:
    docs = yaml.safe_load_all((ROOT / "examples" / "dlodeployment-tenants.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "DLODeployment")["spec"]


def test_the_secret_is_mounted_read_only_and_the_engine_is_told_where():
    sts = builders.build_statefulset(OWNER, parse_spec(example()), "allgather")
    kubernetes_validate.validate(sts, "1.37.0", strict=True)
    pod = sts["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    command = engine["command"]
    assert command[command.index("--api-keys"):command.index("--api-keys") + 4] == \
        ["--api-keys", API_KEYS_MOUNT, "--admin-key", "ops"]
    assert {"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True} in engine["volumeMounts"]
    assert {"name": "api-keys", "secret": {"secretName": "wan-tenants", "defaultMode": 0o440}} in pod["volumes"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]  # the group reads it
    assert API_KEY_ENV not in {e["name"] for e in engine["env"]}
    no_keys = builders.build_statefulset(OWNER, parse_spec({"model": {"path": "/m"}}), "allgather")
    assert "api-keys" not in str(no_keys)


@pytest.mark.parametrize("engine, message", [
    ({"apiKeys": {"secretName": "t"}, "apiKeySecret": {"name": "k"}}, "set engine.apiKeySecret (one key) or"),
    ({"kind": "vllm-omni", "apiKeys": {"secretName": "t"}}, "engine.apiKeys (named keys) is dlo's"),
    ({"apiKeys": {"secretName": "t", "admins": ["Ops_1"]}}, "engine.apiKeys.admins"),
    ({"apiKeys": {"secretName": "t", "admins": ["ops"] * 17}}, "admins"),
    ({"apiKeys": {"admins": ["ops"]}}, "secretName"),
])
def test_a_spec_the_engine_could_not_run_is_refused_naming_the_field(engine, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec({"model": {"path": "/m"}, "engine": engine})
