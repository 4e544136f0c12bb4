"""Shared fixtures for the agent tests: torch-free model folders written byte by byte, and the node
agent over the cgroup-v2 fixture tree with a real engine metrics endpoint (node, collector, server,
pods tests)."""

from __future__ import annotations

import json
import os
import struct
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlo.agent.node import Agent, AgentConfig
from dlo.agent.pods import PodInfo
from dlo.plan.profile import Accelerator
from dlo.agent.topology import Devices


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """Write a safetensors file of random bytes; `tensors` maps name -> (dtype, shape). Returns its size."""
    sizes = {"BF16": 2, "F32": 4, "F16": 2}
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.write(os.urandom(offset))
    return path.stat().st_size


def write_wan_folder(folder: Path, blocks: int = 3, dim: int = 64) -> Path:
    """A pipeline-shaped folder: transformer/ (Wan, `blocks` blocks) and a small vae/."""
    tensors: dict[str, tuple[str, list[int]]] = {"patch_embedding.weight": ("BF16", [dim, 16])}
    for i in range(blocks):
        tensors[f"blocks.{i}.attn1.to_q.weight"] = ("BF16", [dim, dim])
        tensors[f"blocks.{i}.norm2.weight"] = ("F32", [dim])
    t = folder / "transformer"
    t.mkdir(parents=True, exist_ok=True)
    (t / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": blocks}))
    write_safetensors(t / "diffusion_pytorch_model.safetensors", tensors)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    write_safetensors(folder / "vae" / "diffusion_pytorch_model.safetensors", {"w": ("F32", [1024])})
    return folder


@pytest.fixture
def models_root(tmp_path: Path) -> Path:
    """A models root with one Wan pipeline folder `tiny-wan` and one folder that is not a model."""
    root = tmp_path / "models"
    write_wan_folder(root / "tiny-wan")
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "README").write_text("not a model")
    return root


# --- the node agent over the v2 fixture tree ---------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
V2 = FIXTURES / "v2"
V2_POD_A = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"  # a DLO engine pod below
V2_POD_B = "6f5e4d3c-2b1a-4f9e-8d7c-6b5a4f3e2d1c"  # some other workload
MiB = 1 << 20

AGENT_METRICS = {
    "dlo_node_memory_bytes", "dlo_pod_cgroup_memory_bytes", "dlo_pod_pss_bytes", "dlo_pod_host_pinned_bytes",
    "dlo_node_cgroup_invisible_bytes", "dlo_model_bytes", "dlo_model_page_cache_resident_bytes",
    "dlo_model_page_cache_resident_ratio", "dlo_warm_duration_seconds", "dlo_warm_runs",
    "dlo_node_profile_info",
}
H200 = Devices(Accelerator(vendor="nvidia", model="NVIDIA H200", count=8, memory_bytes=150 << 30), "nvlink", None)


class StaticPods:
    """The pods of one node, as the API would list them."""

    def __init__(self, pods: list[PodInfo]):
        self._pods = pods

    def pods(self) -> list[PodInfo]:
        return list(self._pods)


RANK_FACTS = {
    0: {"report": {"weights_source": "arena", "host_pinned_bytes": 1024 * MiB}},
    1: {"report": {"weights_source": "arena", "host_pinned_bytes": 1024 * MiB}},
    2: {"report": {"weights_source": "registered", "host_pinned_bytes": 512 * MiB}},
}


@pytest.fixture
def engine_url() -> Iterator[str]:
    """A real HTTP endpoint serving the engine's own exposition (dlo.serving.metrics) for 3 ranks."""
    from dlo.serving.metrics import EngineMetrics

    body = EngineMetrics(dp=3, rank_facts=lambda: RANK_FACTS).exposition()

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def pods_for(engine_url: str) -> StaticPods:
    host, port = engine_url.removeprefix("http://").split(":")
    labels = {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "engine"}
    return StaticPods([
        PodInfo(V2_POD_A, "serving", "wan-0", host, labels, int(port)),
        PodInfo(V2_POD_B, "other", "batch-job", "10.0.0.9", {"app": "batch"}, None),
    ])


def make_agent(models_root: Path | None, pods: StaticPods | None = None, **kw: object) -> Agent:
    cfg = AgentConfig(node_name="n1", models_root=models_root, proc_root=V2 / "proc", cgroup_root=V2 / "cgroup", **kw)
    return Agent(cfg, devices=H200, pods=pods)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, [])
        for s in fam.samples:
            out[fam.name].append((s.labels, s.value))
    return out




@pytest.fixture
def deep_tree() -> Iterator:
    """`make(folder, depth)`: `depth` nested folders under `folder`, deeper than a recursive walk (or
    shutil.rmtree) goes; removed with `rm -rf` afterwards, so pytest's own clean-up never meets them."""
    import subprocess

    made: list[Path] = []

    def make(folder: Path, depth: int = 1100) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        made.append(folder)
        fd = os.open(folder, os.O_RDONLY)
        try:
            for _ in range(depth):  # relative to a descriptor: no path is ever resolved whole
                os.mkdir("d", dir_fd=fd)
                nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
                os.close(fd)
                fd = nxt
        finally:
            os.close(fd)
        return folder

    yield make
    for folder in made:
        subprocess.run(["rm", "-rf", str(folder)], check=False)
