"""dlo.agent.server: the agent metrics and profile over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.agent.profile import NodeProfile
from dlo.agent.server import serve

from .conftest import AGENT_METRICS, MiB, get, make_agent, pods_for, samples


def test_metrics_endpoint_serves_every_agent_metric_with_contract_labels(models_root: Path, engine_url: str) -> None:
    agent = make_agent(models_root, pods_for(engine_url))
    server = serve(agent, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        agent.warm_models()
        code, text = get(base + "/metrics")
    finally:
        server.shutdown()
    assert code == 200
    got = samples(text)
    assert AGENT_METRICS <= set(got)
    # pod memory: only the DLO pod, named by the API, every contract kind from the v2 tree
    cg = {(lab["namespace"], lab["pod"], lab["kind"]): v for lab, v in got["dlo_pod_cgroup_memory_bytes"]}
    assert {k[:2] for k in cg} == {("serving", "wan-0")}
    assert cg[("serving", "wan-0", "usage")] == 1500 * MiB
    assert cg[("serving", "wan-0", "file_mapped")] == 900 * MiB
    assert {k[2] for k in cg} == {"usage", "peak", "anon", "file", "shmem", "file_mapped", "kernel"}
    assert got["dlo_pod_pss_bytes"] == [({"namespace": "serving", "pod": "wan-0"}, (400_000 + 200_000) * 1024)]
    pinned = {lab["source"]: v for lab, v in got["dlo_pod_host_pinned_bytes"]}
    assert pinned == {"arena": 2 * 1024 * MiB, "registered": 512 * MiB}
    assert got["dlo_node_cgroup_invisible_bytes"] == [({}, 5 * 1024 * MiB)]
    node = {lab["kind"]: v for lab, v in got["dlo_node_memory_bytes"]}
    assert node == {"total": 16 << 30, "available": 12 << 30, "page_cache": 3 << 30, "mlocked": 1 << 20}
    assert [lab["model"] for lab, _ in got["dlo_model_bytes"]] == ["tiny-wan"]
    assert got["dlo_model_page_cache_resident_ratio"][0][1] == pytest.approx(1.0)
    info = got["dlo_node_profile_info"][0][0]
    assert info == {"accelerator": "NVIDIA H200", "count": "8", "interconnect": "nvlink",
                    "can_register_page_cache": "true"}


def test_profile_and_health_endpoints(models_root: Path) -> None:
    fragment = models_root.parent / "cal.json"
    fragment.write_text(json.dumps({"h2d_bandwidth_bps": 50_000_000_000}))
    agent = make_agent(models_root, calibration=fragment)
    server = serve(agent, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        code, body = get(base + "/profile")
        assert code == 200
        p = NodeProfile.model_validate_json(body)
        assert p.node == "n1" and p.measured and p.h2d_bandwidth_bps == 50_000_000_000
        assert p.interconnect.collective_bandwidth_bps == 360_000_000_000  # nominal, not calibrated
        assert set(p.models) == {"tiny-wan"}
        assert p.host_memory_bytes == 16 << 30  # from the fixture /proc
        assert get(base + "/health") == (200, "ok\n")
        assert get(base + "/nope")[0] == 404
    finally:
        server.shutdown()


def test_model_bytes_say_which_size_they_are(models_root: Path) -> None:
    """dlo_model_bytes is the whole folder, /profile models[].bytes the transformer: a second
    metric carries the transformer's size, and both help texts say which is which."""
    from prometheus_client.parser import text_string_to_metric_families

    from dlo.engine.families import describe

    agent = make_agent(models_root)
    server = serve(agent, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        _, text = get(base + "/metrics")
        _, body = get(base + "/profile")
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    folder = models_root / "tiny-wan"
    whole = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    transformer = describe(folder).bytes  # the transformer's tensor bytes (headers excluded)
    transformer_files = sum(f.stat().st_size for f in (folder / "transformer").glob("*.safetensors"))
    assert transformer <= transformer_files < whole  # the VAE makes the difference
    got = samples(text)
    assert got["dlo_model_bytes"] == [({"model": "tiny-wan"}, whole)]
    assert got["dlo_model_transformer_bytes"] == [({"model": "tiny-wan"}, transformer)]
    profile = NodeProfile.model_validate_json(body)
    assert profile.models["tiny-wan"].bytes == transformer
    assert "every file of the model folder" in families["dlo_model_bytes"].documentation
    assert "dlo_model_transformer_bytes" in families["dlo_model_bytes"].documentation
    assert "/profile models[].bytes" in families["dlo_model_transformer_bytes"].documentation
    # the profile's schema says the same (kubectl-style readers and `dlo plan --help` users)
    fields = NodeProfile.model_json_schema()["$defs"]["ModelProfile"]["properties"]
    assert "transformer only" in fields["bytes"]["description"] and "dlo_model_bytes" in fields["bytes"]["description"]
