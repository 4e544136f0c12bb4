"""Every `dlo` subcommand answers a bad value with one line on stderr and exit 2, never a traceback.

One row per bad value: (argv, a fragment the message must contain). `{tmp}` in an argument is a
folder holding the inputs `inputs` writes (a model folder, an empty folder, profile and calibration
files with a typo'd key, DLODeployment files). Each row runs the real `dlo` entry point in a
subprocess. To cover a new flag, add a row to the table of the part that owns the subcommand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .agent.conftest import write_wan_folder

ROOT = Path(__file__).resolve().parents[1]
DLO = Path(sys.executable).parent / "dlo"  # the console script `pip install` made

BYTES = ["--model-bytes", "60000000000", "--max-block-bytes", "1200000000"]
PROFILE = {
    "version": "v1", "node": "gpu-1",
    "accelerator": {"vendor": "nvidia", "model": "NVIDIA H200", "count": 8, "memory_bytes": 150_000_000_000},
    "interconnect": {"kind": "nvlink", "collective_bandwidth_bps": 360_000_000_000},
    "h2d_bandwidth_bps": 55_000_000_000, "host_memory_bytes": 2_000_000_000_000,
}
DLOD = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment", "metadata": {"name": "wan"},
        "spec": {"model": {"path": "/models/wan"}}}

AGENT_ROWS: list[tuple[list[str], str]] = [
    # dlo warm
    (["warm", "--threads", "0", "{tmp}/model"], "--threads: must be at least 1 (got 0)"),
    (["warm", "--threads", "-4", "{tmp}/model"], "--threads: must be at least 1 (got -4)"),
    (["warm", "--threads", "two", "{tmp}/model"], "'two' is not an integer"),
    (["warm", "--threshold", "1.5", "{tmp}/model"], "--threshold: must be a ratio from 0 to 1"),
    (["warm", "--threshold", "99", "{tmp}/model"], "--threshold: must be a ratio from 0 to 1"),
    (["warm", "--threshold", "-0.1", "{tmp}/model"], "--threshold: must be a ratio from 0 to 1"),
    (["warm", "--threshold", "nan", "{tmp}/model"], "'nan' is not a finite number"),
    (["warm", "{tmp}/missing"], "{tmp}/missing: no such file or folder"),
    (["warm", "{tmp}/empty"], "no *.safetensors file under {tmp}/empty"),
    (["warm", "{tmp}/model/model_index.json"], "{tmp}/model/model_index.json: not a safetensors file"),
    (["warm"], "the following arguments are required: PATH"),
    # dlo plan
    (["plan", "--model-bytes", "0", "--max-block-bytes", "1"], "--model-bytes: must be at least 1 (got 0)"),
    (["plan", "--model-bytes", "-5", "--max-block-bytes", "1"], "--model-bytes: must be at least 1 (got -5)"),
    (["plan", "--model-bytes", "ten", "--max-block-bytes", "1"], "'ten' is not an integer"),
    (["plan", "--model-bytes", "10", "--max-block-bytes", "0"], "--max-block-bytes: must be at least 1"),
    (["plan", "--model-bytes", "10", "--max-block-bytes", "20"], "--max-block-bytes (20) is larger than --model-bytes (10)"),
    (["plan", "--model-bytes", "10"], "--model-bytes needs --max-block-bytes"),
    (["plan", *BYTES, "--dp", "0"], "--dp: must be at least 1 (got 0)"),
    (["plan", *BYTES, "--dp", "-2"], "--dp: must be at least 1 (got -2)"),
    (["plan", *BYTES, "--dp", "99999999999999999999999"], "--dp: must be at most 1024 ranks on one node"),
    (["plan", *BYTES, "--dp", "64", "--sp", "64"], "--dp x --sp is 4096 ranks; at most 1024 on one node"),
    (["plan", *BYTES, "--max-device-memory", "0"], "--max-device-memory: must be at least 1 byte"),
    (["plan", *BYTES, "--max-device-memory", "24Gi"], "--max-device-memory: '24Gi' is not a byte count"),
    (["plan", *BYTES, "--limits", "{tmp}/profile.json"], "--limits and --max-size need --model PIPELINE_DIR"),
    (["plan", *BYTES, "--sp", "0"], "--sp: must be at least 1 (got 0)"),
    (["plan", *BYTES, "--tokens", "0"], "--tokens: must be at least 1 (got 0)"),
    (["plan", *BYTES, "--blocks", "-1"], "--blocks: must be 0 or more (got -1)"),
    (["plan", *BYTES, "--block-compute-seconds", "-1"], "--block-compute-seconds: must be 0 seconds or more"),
    (["plan", *BYTES, "--host-memory-bytes", "0"], "--host-memory-bytes: must be at least 1 (got 0)"),
    (["plan", *BYTES, "--host-headroom-bytes", "-1"], "--host-headroom-bytes: must be 0 or more"),
    (["plan", *BYTES, "--profile", "{tmp}/profile.json", "--host-headroom-bytes", str(10**13)],
     "--host-headroom-bytes (10000000000000) leaves nothing"),
    (["plan", "--model", "{tmp}/missing"], "--model: {tmp}/missing: no such file or folder"),
    (["plan", "--model", "{tmp}/empty"], "{tmp}/empty/config.json: unreadable model config"),
    (["plan", "--model", "{tmp}/model", "--max-block-bytes", "5"], "--max-block-bytes goes with --model-bytes"),
    (["plan", *BYTES, "--profile", "{tmp}/missing.json"], "--profile: {tmp}/missing.json: no such file or folder"),
    (["plan", *BYTES, "--profile", "{tmp}"], "--profile: {tmp}: not a file"),
    (["plan", *BYTES, "--profile", "{tmp}/typo-profile.json"], "unknown key 'host_memory_byte'"),
    (["plan", *BYTES, "--profile", "{tmp}/typo-nested-profile.json"], "unknown key 'accelerator.memory_byte'"),
    (["plan", *BYTES, "--profile", "{tmp}/not-json.json"], "{tmp}/not-json.json: not JSON"),
    (["plan", *BYTES, "--profile", "{tmp}/bad-version-profile.json"], "version: Input should be 'v1'"),
    (["plan", *BYTES, "--profile", "{tmp}/profile.json", "--calibration", "{tmp}/typo-calibration.json"],
     "unknown key 'h2d_bandwith_bps'"),
    (["plan", *BYTES, "--profile", "{tmp}/profile.json", "--calibration", "{tmp}/negative-calibration.json"],
     "h2d_bandwidth_bps: Input should be greater than 0"),
    # dlo agent
    (["agent", "--port", "99999"], "--port: must be a port from 0 to 65535 (got 99999)"),
    (["agent", "--port", "-1"], "--port: must be a port from 0 to 65535 (got -1)"),
    (["agent", "--warm-threshold", "2"], "--warm-threshold: must be a ratio from 0 to 1"),
    (["agent", "--publish-interval", "0"], "--publish-interval: must be more than 0 seconds"),
    (["agent", "--warm-interval", "-5"], "--warm-interval: must be more than 0 seconds"),
    (["agent", "--models-root", "{tmp}/missing"], "--models-root: {tmp}/missing: no such file or folder"),
    (["agent", "--proc-root", "{tmp}/missing"], "--proc-root: {tmp}/missing: no such file or folder"),
    (["agent", "--cgroup-root", "{tmp}/profile.json"], "--cgroup-root: {tmp}/profile.json: not a folder"),
    (["agent", "--calibration", "{tmp}/missing.json"], "--calibration: {tmp}/missing.json: no such file"),
    (["agent", "--kubernetes", "off", "--port", "0", "--calibration", "{tmp}/typo-calibration.json"],
     "unknown key 'h2d_bandwith_bps'"),
    (["agent", "--engine-url", "localhost:8000"], "'localhost:8000' is not an http:// or https:// URL"),
    (["agent", "--engine-url", "http://127.0.0.1:99999"], "the port must be from 0 to 65535"),
    (["agent", "--node-name", " "], "--node-name must not be empty"),
    (["agent", "--kubernetes", "maybe"], "--kubernetes: invalid choice: 'maybe'"),
    (["agent", "--log-format", "xml"], "--log-format: 'xml' is not a log format: text or json"),
    (["warm", "--log-format", "yaml", "{tmp}/model"], "--log-format: 'yaml' is not a log format: text or json"),
]

OPERATOR_ROWS: list[tuple[list[str], str]] = [
    (["crd", "--write", "--root", "{tmp}/missing"], "--root: {tmp}/missing: no such file or folder"),
    (["operator"], "a subcommand is needed: run or render"),
    (["operator", "bogus"], "unknown subcommand 'bogus'"),
    (["operator", "render"], "the following arguments are required: file"),
    (["operator", "render", "{tmp}/missing.yaml"], "{tmp}/missing.yaml: no such file or folder"),
    (["operator", "render", "{tmp}/not-yaml.yaml"], "{tmp}/not-yaml.yaml"),
    (["operator", "render", "{tmp}/profile.json"], "no dlo.dev/v1alpha1 DLODeployment document"),
    (["operator", "render", "{tmp}/negative-replicas.yaml"], "spec.replicas: Input should be greater than or equal to 0"),
    (["operator", "render", "{tmp}/dlod.yaml", "--profile", "{tmp}/typo-profile.json"], "unknown key 'host_memory_byte'"),
    (["operator", "render", "{tmp}/dlod.yaml", "--profile", "{tmp}/missing.json"], "--profile: {tmp}/missing.json: no such file"),
    (["operator", "run", "--status-interval", "0"], "--status-interval: must be more than 0 seconds"),
    (["operator", "run", "--status-interval", "-1"], "--status-interval: must be more than 0 seconds"),
    (["operator", "run", "--namespace", "Bad_NS"], "'Bad_NS' is not a namespace name"),
    (["operator", "run", "--liveness", "ftp://example"], "'ftp://example' is not an http:// or https:// URL"),
    (["operator", "run", "--max-fetches", "0"], "--max-fetches: must be at least 1 (got 0)"),
    (["operator", "run", "--fetch-retry", "0"], "--fetch-retry: must be more than 0 seconds"),
    (["operator", "run", "--cache-disk-budget", "lots"], "--cache-disk-budget: 'lots' is not a number"),
    (["operator", "run", "--prometheus-url", "prometheus:9090"], "'prometheus:9090' is not an http:// or https:// URL"),
    (["operator", "run", "--network-policy", "--client-namespace-selector", "team=ml"], "--client-namespace-selector: not JSON"),
    (["operator", "run", "--network-policy", "--client-namespace-selector", '{"matchLabel": {}}'],
     "unknown field 'matchLabel'"),
    (["operator", "run", "--network-policy", "--monitoring-namespace", "Mon"], "'Mon' is not a namespace name"),
    (["operator", "run", "--monitoring-namespace", "monitoring"], "need --network-policy"),
    (["operator", "render", "{tmp}/dlod.yaml", "--agent-namespace", "dlo"], "need --network-policy"),
    (["operator", "run", "--fetch-user", "0"], "--fetch-user: must be at least 1 (got 0)"),
    (["operator", "run", "--cache-ownership", "root"], "--cache-ownership: invalid choice: 'root'"),
    (["operator", "run", "--log-format", "logfmt"], "--log-format: 'logfmt' is not a log format: text or json"),
]

ENGINE_ROWS: list[tuple[list[str], str]] = [
    (["serve", "{tmp}/model", "--port", "99999"], "--port: must be a port from 0 to 65535 (got 99999)"),
    (["serve", "{tmp}/model", "--dp", "0"], "--dp: must be at least 1 (got 0)"),
    (["serve", "{tmp}/model", "--max-queue", "0"], "--max-queue: must be at least 1 (got 0)"),
    (["serve", "{tmp}/model", "--log-format", "JSON"], "--log-format: 'JSON' is not a log format: text or json"),
    (["serve", "{tmp}/model", "--cpu-threads", "-2"], "--cpu-threads: must be at least 1 (got -2)"),
    (["serve", "{tmp}/model", "--progress-timeout", "0"], "--progress-timeout: must be more than 0 seconds"),
    (["serve", "{tmp}/model", "--mode", "fast"], "--mode: invalid choice: 'fast'"),
    (["serve", "{tmp}/model", "--stream-dtype", "fp16"], "--stream-dtype: invalid choice: 'fp16'"),
    (["serve", "{tmp}/model", "--cache", "fast"], "--cache: preset must be one of first-block, taylorseer, mag"),
    (["serve", "{tmp}/model", "--cache", '{"preset": "mag"}'], "--cache: mag_ratios is required by preset 'mag'"),
    (["serve", "{tmp}/model", "--gather", "nccl"], "--gather: invalid choice: 'nccl'"),
    (["serve", "{tmp}/model", "--gather-max-ctas", "65"], "--gather-max-ctas: must be at most 64 (got 65)"),
    (["serve", "{tmp}/model", "--gather-max-ctas", "0"], "--gather-max-ctas: must be at least 1 (got 0)"),
    (["serve", "{tmp}/model", "--ulysses-exchange", "fast"], "--ulysses-exchange: invalid choice: 'fast'"),
    (["serve", "{tmp}/model", "--lora-dir", "{tmp}/missing"], "--lora-dir: {tmp}/missing: no such file or folder"),
    (["make-random-lora", "{tmp}/model", "{tmp}/new-lora", "--rank", "0"], "--rank: must be at least 1 (got 0)"),
    (["make-random-lora", "{tmp}/model", "{tmp}/new-lora", "--rank", "4", "--format", "lycoris"],
     "--format: invalid choice: 'lycoris'"),
    (["make-random-lora", "{tmp}/missing", "{tmp}/new-lora", "--rank", "4"], "{tmp}/missing: no such file or folder"),
    (["make-random-lora", "{tmp}/model", "{tmp}/model", "--rank", "4"], "{tmp}/model already exists"),
    (["serve", "{tmp}/model", "--dp", "99999999999999999999999"], "--dp: must be at most 1024 ranks on one node"),
    (["serve", "{tmp}/model", "--api-key-file", "{tmp}/missing"], "--api-key-file: {tmp}/missing: no such file"),
    (["serve", "{tmp}/model", "--api-key-file", "{tmp}"], "--api-key-file: {tmp}: not a file"),
    (["serve", "{tmp}/model", "--api-key-file", "{tmp}/latin1-key"], "{tmp}/latin1-key: not UTF-8 text"),
    (["serve", "{tmp}/model", "--api-key-file", "{tmp}/spaced-key"], "a key must be printable ASCII"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/missing"], "--api-keys: {tmp}/missing: no such file or folder"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/bad-name-keys"], "line 2: the name before ':' is not a key name"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/twice-keys"], "'alice' and 'bob' have the same key"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/spaced-key"], "line 1: expected 'name: key'"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/empty"], "{tmp}/empty holds no keys"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/keys", "--admin-key", "ops"], "--admin-key ops: no key"),
    (["serve", "{tmp}/model", "--api-keys", "{tmp}/keys", "--api-key-file", "{tmp}/latin1-key"],
     "both give keys"),
    (["serve", "{tmp}/model", "--admin-key", "Ops_1"], "--admin-key: 'Ops_1' is not a DNS label"),
    (["serve", "{tmp}/model", "--admin-key", "ops"], "names a key of --api-keys, which is not given"),
    (["serve", "{tmp}/model", "--max-queue-per-tenant", "0"], "--max-queue-per-tenant: must be at least 1 (got 0)"),
    (["serve", "{tmp}/model", "--max-video-jobs-per-tenant", "0"], "--max-video-jobs-per-tenant: must be at least 1"),
    (["serve", "{tmp}/model", "--body-timeout", "0"], "--body-timeout: must be more than 0 seconds"),
    (["serve", "{tmp}/model", "--min-body-rate", "0"], "--min-body-rate: must be at least 1 (got 0)"),
    (["serve", "{tmp}/model", "--probe-cidr", "10.0.0.0/33"], "'10.0.0.0/33' is not a network"),
    (["serve", "{tmp}/model", "--startup-timeout", "-1"], "--startup-timeout: must be more than 0 seconds"),
    (["make-tiny-model", "{tmp}/new-tiny", "--dim", "17"], "--dim: must be a multiple of"),
    (["make-tiny-model", "{tmp}/new-tiny", "--layers", "0"], "--layers: must be at least 1 (got 0)"),
    (["make-tiny-model", "{tmp}/model"], "{tmp}/model exists and is not an empty folder"),
    (["make-random-model", "{tmp}/new-random", "--preset", "nope"], "--preset: invalid choice: 'nope'"),
    (["make-random-model", "{tmp}/new-random", "--preset", "tiny-wan2.1-t2v", "--layers", "0"],
     "--layers: must be at least 1 (got 0)"),
    (["make-random-model", "{tmp}/model", "--preset", "tiny-wan2.1-t2v"], "{tmp}/model exists and is not an empty folder"),
    (["quantize", "{tmp}/model", "{tmp}/new-q", "--dtype", "int4"], "--dtype: invalid choice: 'int4'"),
    (["quantize", "{tmp}/empty", "{tmp}/new-q", "--dtype", "fp8"], "SRC {tmp}/empty: not a pipeline folder"),
    (["quantize", "{tmp}/model", "{tmp}/model/q", "--dtype", "fp8"], "lies inside SRC"),
    (["quantize", "{tmp}/model", "{tmp}/model", "--dtype", "fp8"], "{tmp}/model exists and is not an empty folder"),
    (["fuse-lora", "{tmp}/model", "{tmp}/model:abc", "{tmp}/new-fused"], "SCALE 'abc' must be a finite number"),
    (["fuse-lora", "{tmp}/model", "{tmp}/missing:0.5", "{tmp}/new-fused"], "{tmp}/missing: no such file or folder"),
    (["calibrate", "--ranks", "0"], "--ranks: must be at least 1 (got 0)"),
    (["calibrate", "--mib", "x"], "--mib: 'x' is not an integer"),
    (["demo", "--dp", "0"], "--dp: must be at least 1 (got 0)"),
    (["demo", "--steps", "10"], "--steps 10: the demo serves the small limits, at most 4 steps"),
    (["demo", "--size", "100x100"], "--size: size 100x100: width and height must be multiples of 16"),
    (["demo", "--size", "256x256"], "--size: size 256x256 exceeds this server's limit of 128x128"),
]

DELIVERY_ROWS: list[tuple[list[str], str]] = [
    (["fetch", "ftp://models/wan", "{tmp}/dest"], "'ftp://models/wan' is not a model URI"),
    (["fetch", "s3://Bad_Bucket/wan", "{tmp}/dest"], "'Bad_Bucket' is not an S3 bucket name"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--revision", "v2"], "S3 models have no revision"),
    (["fetch", "hf://org/name@v1", "{tmp}/dest", "--revision", "v2"], "the URI names revision 'v1' but --revision is 'v2'"),
    (["fetch", "hf://just-a-name", "{tmp}/dest"], "is not a Hugging Face repo id (org/name)"),
    (["fetch", "s3://models/wan", "{tmp}/model"], "exists and is not a folder `dlo fetch` published"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--concurrency", "0"], "--concurrency: must be at least 1 (got 0)"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--part-size", "big"], "--part-size: 'big' is not a byte count"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--disk-budget", "0"], "--disk-budget: must be at least 1 byte"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--endpoint", "minio:9000"], "'minio:9000' is not an http://"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--progress", "fancy"], "--progress: invalid choice: 'fancy'"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--kind", "adapters"], "--kind: invalid choice: 'adapters'"),
    (["fetch", "s3://models/wan", "{tmp}/dest", "--log-format", "xml"], "--log-format: 'xml' is not a log format"),
    (["serve", "s3://Bad_Bucket/wan"], "'Bad_Bucket' is not an S3 bucket name"),
]

ALL_ROWS = AGENT_ROWS + OPERATOR_ROWS + ENGINE_ROWS + DELIVERY_ROWS


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cli-inputs")
    write_wan_folder(tmp / "model")
    (tmp / "empty").mkdir()
    (tmp / "profile.json").write_text(json.dumps(PROFILE))
    typo = {**PROFILE, "host_memory_byte": PROFILE["host_memory_bytes"]}
    del typo["host_memory_bytes"]
    (tmp / "typo-profile.json").write_text(json.dumps(typo))
    nested = {**PROFILE, "accelerator": {**PROFILE["accelerator"], "memory_byte": 1}}  # type: ignore[dict-item]
    (tmp / "typo-nested-profile.json").write_text(json.dumps(nested))
    (tmp / "bad-version-profile.json").write_text(json.dumps({**PROFILE, "version": "v9"}))
    (tmp / "not-json.json").write_text('{"version": "v1",')
    (tmp / "typo-calibration.json").write_text(json.dumps({"h2d_bandwith_bps": 10**10}))
    (tmp / "negative-calibration.json").write_text(json.dumps({"h2d_bandwidth_bps": -1}))
    (tmp / "dlod.yaml").write_text(yaml.safe_dump(DLOD))
    (tmp / "negative-replicas.yaml").write_text(yaml.safe_dump({**DLOD, "spec": {**DLOD["spec"], "replicas": -1}}))
    (tmp / "not-yaml.yaml").write_text("spec: [unclosed\n  - : :\n")
    (tmp / "latin1-key").write_bytes(b"caf\xe9")
    (tmp / "spaced-key").write_text("two words\n")
    (tmp / "bad-name-keys").write_text("alice: sk-a\nAlice_2: sk-b\n")  # the name is not echoed: it may be a key
    (tmp / "twice-keys").write_text("# tenants\nalice: sk-same\n\nbob: sk-same\n")
    (tmp / "keys").write_text("alice: sk-a\nbob: sk-b\n")
    return tmp


def _row_id(row: tuple[list[str], str]) -> str:
    return " ".join(row[0]).replace("{tmp}/", "")


@pytest.mark.parametrize("argv, fragment", ALL_ROWS, ids=[_row_id(r) for r in ALL_ROWS])
def test_bad_value_is_one_line_and_exit_2(inputs: Path, argv: list[str], fragment: str) -> None:
    args = [a.replace("{tmp}", str(inputs)) for a in argv]
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}  # never a cluster here
    env.update(COLUMNS="80", DLO_LOG_LEVEL="WARNING")
    r = subprocess.run([str(DLO), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    message = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "\n" not in message, f"more than one line:\n{r.stderr}"
    assert fragment.replace("{tmp}", str(inputs)) in message
    assert r.stdout == ""


def test_every_subcommand_has_rows() -> None:
    from dlo.cli.main import COMMANDS

    covered = {argv[0] for argv, _ in ALL_ROWS}
    assert {c for c, (part, _) in COMMANDS.items() if part in ("agent", "operator", "engine", "delivery")} <= covered
    assert {"run", "render"} <= {argv[1] for argv, _ in OPERATOR_ROWS if argv[0] == "operator" and len(argv) > 1}
