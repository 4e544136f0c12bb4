"""operator/cli.py: `dlo crd`, `dlo operator render`, `dlo operator --help` (run as real commands)."""

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

from cluster import dlodeployment, running_cluster
from dlo.operator.cli import crd_yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dlodeployment.yaml"
PROFILES = ROOT / "examples" / "profiles"


def dlo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlo.cli.main", *args], cwd=cwd, capture_output=True, text=True)


def test_crd_prints_the_generated_crd():
    proc = dlo("crd")
    assert proc.returncode == 0 and proc.stdout == crd_yaml()
    assert yaml.safe_load(proc.stdout)["metadata"]["name"] == "dlodeployments.dlo.dev"


def test_crd_write_writes_both_copies(tmp_path):
    proc = dlo("crd", "--write", "--root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for rel in ("crds/dlo.dev_dlodeployments.yaml", "charts/dlo/crds/dlo.dev_dlodeployments.yaml"):
        assert (tmp_path / rel).read_text() == crd_yaml()


def test_render_prints_every_object_as_a_yaml_stream():
    proc = dlo("operator", "render", str(EXAMPLE))
    assert proc.returncode == 0, proc.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout)]
    assert kinds == ["Service", "Service", "PodDisruptionBudget", "StatefulSet", "PodMonitor"]  # monitoring: default on
    proc = dlo("operator", "render", str(EXAMPLE), "--no-monitoring-crd")
    assert [d["kind"] for d in yaml.safe_load_all(proc.stdout)][-1] == "StatefulSet"
    assert "wan: mode allgather" in proc.stderr and "no eligible node" in proc.stderr


def test_render_resolves_auto_from_profiles():
    proc = dlo("operator", "render", str(EXAMPLE), "--profile", str(PROFILES / "h200-node.json"))
    sts = [d for d in yaml.safe_load_all(proc.stdout) if d["kind"] == "StatefulSet"][0]
    cmd = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--mode") + 1] == "resident"
    proc = dlo("operator", "render", str(EXAMPLE), "--profile", str(PROFILES / "h200-node.json"),
               "--profile", str(PROFILES / "l4-node.json"))
    assert "mode allgather (node gpu-node-2" in proc.stderr


def test_render_invalid_spec_exits_2_with_the_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment",
                                   "metadata": {"name": "x"}, "spec": {"model": {}}}))
    proc = dlo("operator", "render", str(bad))
    assert proc.returncode == 2 and "exactly one of model.path" in proc.stderr
    other = tmp_path / "other.yaml"
    other.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    proc = dlo("operator", "render", str(other))
    assert proc.returncode == 2 and "no dlo.dev/v1alpha1 DLODeployment" in proc.stderr


def test_help_for_every_subcommand():
    assert "render FILE" in dlo("operator", "--help").stdout
    for args in (("operator", "run", "--help"), ("operator", "render", "--help"), ("crd", "--help")):
        proc = dlo(*args)
        assert proc.returncode == 0 and "usage: dlo" in proc.stdout, args
    proc = dlo("operator", "frobnicate")
    assert proc.returncode == 2 and "unknown subcommand" in proc.stderr


def test_operator_never_imports_torch():
    code = ("import sys, dlo.operator.cli, dlo.operator.handlers, dlo.operator.builders, dlo.operator.modes;"
            "from dlo.operator.modes import resolve_mode; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubeconfig_for(cluster, tmp_path: Path) -> Path:
    """A kubeconfig whose current context is the emulator."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": str(cluster.emulator.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "test"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test"}}],
    }))
    return kubeconfig


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_operator_run_reconciles_from_a_kubeconfig_and_serves_liveness_and_metrics(tmp_path):
    """`dlo operator run` as a real process: kubeconfig login, the handlers, the liveness endpoint,
    its own metrics on --metrics-port, and the default engine image from DLO_DEFAULT_ENGINE_IMAGE."""
    health_port, metrics_port = free_port(), free_port()
    async with running_cluster(with_operator=False) as cluster:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig_for(cluster, tmp_path)),
               "DLO_DEFAULT_ENGINE_IMAGE": "registry.example/dlo:7"}
        log = (tmp_path / "operator.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dlo.cli.main", "operator", "run", "--status-interval", "1",
            # Cluster-wide: kmock 0.8 cannot parse kopf's namespace listing (GET /api/v1/namespaces).
            "--liveness", f"http://127.0.0.1:{health_port}/healthz", "--metrics-port", str(metrics_port),
            cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )
        log.close()
        try:
            await cluster.add_node("node-0", allocatable={"nvidia.com/gpu": "1"})
            await cluster.create(dlodeployment("tiny", "serving", {"model": {"path": "/models/tiny"}}))
            await cluster.wait(lambda: cluster.get("StatefulSet", "serving", "tiny"), timeout=30, what="the StatefulSet")
            await cluster.wait(lambda: ((cluster.get("DLODeployment", "serving", "tiny") or {}).get("status") or {})
                               .get("readyReplicas") == 1, timeout=30, what="status from the timer")
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{health_port}/healthz") as resp:
                    assert resp.status == 200
            sts = cluster.get("StatefulSet", "serving", "tiny")
            assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/dlo:7"
            status = cluster.get("DLODeployment", "serving", "tiny")["status"]
            assert status["url"] == "http://tiny.serving.svc:8000"

            async def scrape() -> dict:
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                        assert resp.status == 200
                        return samples(await resp.text())

            async def ready_counted() -> bool:
                got = await scrape()
                return got.get(("dlo_operator_dlodeployments", (("condition", "Ready"), ("status", "True")))) == 1

            for _ in range(100):
                if await ready_counted():
                    break
                await asyncio.sleep(0.2)
            got = await scrape()
            assert got[("dlo_operator_dlodeployments", (("condition", "Ready"), ("status", "True")))] == 1
            assert got[("dlo_operator_dlodeployments", (("condition", "Degraded"), ("status", "False")))] == 1
            assert got[("dlo_operator_reconciles_total", (("result", "success"),))] >= 1
            assert got[("dlo_operator_reconciles_total", (("result", "api_error"),))] == 0
            assert got[("dlo_operator_reconcile_duration_seconds_count", ())] >= 1
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), timeout=30) is not None


def test_render_refuses_typos_in_kubernetes_types_naming_the_field(tmp_path):
    res = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment", "metadata": {"name": "wan"},
           "spec": {"model": {"path": "/models/wan"},
                    "engine": {"resources": {"limts": {"cpu": "1"}}, "env": [{"nmae": "A", "value": "b"}]},
                    "placement": {"affinity": {"nodeAfinity": {}}}}}
    path = tmp_path / "typos.yaml"
    path.write_text(yaml.safe_dump(res))
    proc = dlo("operator", "render", str(path))
    assert proc.returncode == 2 and proc.stdout == ""
    for field in ("spec.engine.resources.limts", "spec.engine.env.0.nmae", "spec.placement.affinity.nodeAfinity"):
        assert f"{field}: unknown field" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def render_file(tmp_path: Path, spec: dict, name: str = "wan", namespace: str = "serving") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dlodeployment(name, namespace, spec)))
    return path


def test_render_prints_the_autoscaler_of_the_crds_assumed_installed(tmp_path):
    spec = {"model": {"path": "/models/wan"}, "autoscaling": {"enabled": True, "maxReplicas": 3}}
    kinds = [d["kind"] for d in yaml.safe_load_all(dlo("operator", "render", str(render_file(tmp_path, spec))).stdout)]
    assert kinds[-1] == "HorizontalPodAutoscaler"  # engine auto without KEDA
    proc = dlo("operator", "render", str(render_file(tmp_path, spec)), "--assume", "keda")
    (scaled,) = [d for d in yaml.safe_load_all(proc.stdout) if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["maxReplicaCount"] == 3 and "wan" in scaled["spec"]["triggers"][0]["metadata"]["query"]
    keda_only = {**spec, "autoscaling": {**spec["autoscaling"], "engine": "keda"}}
    proc = dlo("operator", "render", str(render_file(tmp_path, keda_only)))
    assert not {"ScaledObject", "HorizontalPodAutoscaler"} & {d["kind"] for d in yaml.safe_load_all(proc.stdout)}
    assert "warning: autoscaling.engine keda but KEDA's ScaledObject CRD is not installed" in proc.stderr
    assert dlo("operator", "render", str(render_file(tmp_path, spec)), "--assume", "hpa").returncode == 2


async def test_render_prints_what_the_operator_creates(tmp_path):
    """The same objects, field for field, as the operator applies on the emulated cluster with the
    same nodes (profiles), KEDA and the monitoring CRDs installed: the plan's memory request, the
    monitor and the ScaledObject included."""
    import kmock

    spec = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d["kind"] == "DLODeployment")["spec"]
    spec = {**spec, "autoscaling": {"enabled": True, "maxReplicas": 3}, "monitoring": {"enabled": True},
            "videos": {"claimName": "videos"}, "engine": {k: v for k, v in spec["engine"].items() if k != "resources"}}
    path = render_file(tmp_path, spec)
    profiles = [str(PROFILES / "h200-node.json"), str(PROFILES / "l4-node.json")]
    proc = dlo("operator", "render", str(path), "--assume", "keda", *[a for p in profiles for a in ("--profile", p)])
    assert proc.returncode == 0, proc.stderr
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(proc.stdout)}
    assert set(k for k, _ in rendered) == {"Service", "PodDisruptionBudget", "StatefulSet", "PodMonitor", "ScaledObject"}
    async with running_cluster() as cluster:
        for plural, kind in (("monitoring.coreos.com/v1/podmonitors", "PodMonitor"),
                             ("keda.sh/v1alpha1/scaledobjects", "ScaledObject")):
            cluster.emulator.resources[plural] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=True, verbs={"get", "list", "watch", "create", "patch"})
        from dlo.operator.cli import profile_node
        from dlo.operator.models import parse_spec

        for p in profiles:
            await cluster.create(profile_node(Path(p), parse_spec(spec)))
        await cluster.create(dlodeployment("wan", "serving", spec))
        await cluster.wait(lambda: all(cluster.get(k, "serving", n) for k, n in rendered), what="every object")
        for (kind, name), want in rendered.items():
            live = cluster.get(kind, "serving", name)
            assert live["spec"] == want["spec"], (kind, name)
            for field in ("labels", "annotations"):
                assert live["metadata"].get(field) == want["metadata"].get(field), (kind, name, field)
    engine = rendered[("StatefulSet", "wan")]["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["requests"]["memory"] != "16Gi"  # the plan's estimate, not 2Gi a rank without facts


async def http_status(url: str) -> int | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            async with session.get(url) as resp:
                return resp.status
    except aiohttp.ClientError:
        return None


async def test_two_operator_processes_one_leads_and_the_standby_takes_over_after_a_kill(tmp_path):
    """`dlo operator run --leader-elect` twice: one holds the Lease and reconciles, the other answers
    its liveness probe and waits; SIGKILL the leader and the standby applies a change within 30 s;
    SIGTERM releases the lease and exits 0."""
    async with running_cluster(with_operator=False) as cluster:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig_for(cluster, tmp_path)), "POD_NAMESPACE": "dlo-system"}
        procs, health = {}, {}

        async def start(name: str) -> None:
            health[name], metrics_port = free_port(), free_port()
            procs[name] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "dlo.cli.main", "operator", "run", "--leader-elect", "--status-interval", "1",
                "--liveness", f"http://127.0.0.1:{health[name]}/healthz", "--metrics-port", str(metrics_port),
                cwd=ROOT, env={**env, "POD_NAME": name}, stdout=asyncio.subprocess.DEVNULL,
                stderr=(tmp_path / f"{name}.log").open("wb"))

        def holder() -> str:
            lease = cluster.get("Lease", "dlo-system", "dlo-operator")
            return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""

        try:
            await start("op-a")
            await cluster.wait(lambda: holder().startswith("op-a_"), timeout=30, what="op-a leads")
            await start("op-b")
            for _ in range(150):  # the standby answers its liveness probe before kopf runs
                if await http_status(f"http://127.0.0.1:{health['op-b']}/healthz") == 200:
                    break
                await asyncio.sleep(0.2)
            assert await http_status(f"http://127.0.0.1:{health['op-b']}/healthz") == 200
            await cluster.add_node("node-0", allocatable={"nvidia.com/gpu": "1"})
            await cluster.create(dlodeployment("tiny", "serving", {"model": {"path": "/models/tiny"}}))
            await cluster.wait(lambda: cluster.get("StatefulSet", "serving", "tiny"), timeout=30, what="reconciled")
            assert holder().startswith("op-a_")
            procs["op-a"].kill()
            await procs["op-a"].wait()
            killed = asyncio.get_running_loop().time()
            await cluster.patch_dlod("serving", "tiny", {"spec": {"replicas": 0}})
            await cluster.wait(lambda: cluster.get("StatefulSet", "serving", "tiny")["spec"]["replicas"] == 0,
                               timeout=30, what="the standby applies the change")
            print(f"FIGURE failover process seconds={asyncio.get_running_loop().time() - killed:.1f}")
            assert holder().startswith("op-b_")
            procs["op-b"].terminate()
            assert await asyncio.wait_for(procs["op-b"].wait(), timeout=30) == 0
            assert holder() == ""  # released on the way out: a new replica need not wait
        finally:
            for proc in procs.values():
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
