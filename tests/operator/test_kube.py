"""operator/kube.py: the small client, against the kmock emulator (real HTTP)."""

import asyncio

import kmock
import pytest

from cluster import Emulator
from dlo.operator.kube import Kube, KubeError, contains


def test_contains_is_a_deep_subset_check():
    assert contains({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}}, {"b": {"c": [1, {"d": 2}]}})
    assert not contains({"a": 1}, {"a": 2})
    assert not contains({"l": [1, 2]}, {"l": [1]})  # lists must match in length: merge-patch replaces them
    assert contains({}, {"a": None})  # merge-patch null: absent is already right


def service(port: int = 80) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ns"},
            "spec": {"ports": [{"port": port}]}}


@pytest.fixture
async def emulator():
    emu = Emulator()
    emu.resources.load_bundled()
    async with emu, kmock.Server(emu):
        yield emu


async def test_apply_creates_then_is_unchanged_then_patches(emulator):
    kube = Kube.for_url(str(emulator.url))
    assert await asyncio.to_thread(kube.apply, service()) == "created"
    assert await asyncio.to_thread(kube.apply, service()) == "unchanged"
    assert await asyncio.to_thread(kube.apply, service(81)) == "patched"
    got = await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s")
    assert got["spec"]["ports"] == [{"port": 81}]


async def test_apply_prunes_fields_the_desired_object_no_longer_has(emulator):
    kube = Kube.for_url(str(emulator.url))
    rolling = service()
    rolling["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    prune = (("spec", "strategy", "rollingUpdate"),)
    assert await asyncio.to_thread(kube.apply, rolling, prune) == "created"
    on_delete = service()
    on_delete["spec"]["strategy"] = {"type": "OnDelete"}
    assert await asyncio.to_thread(kube.apply, on_delete, prune) == "patched"
    got = await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s")
    assert got["spec"]["strategy"] == {"type": "OnDelete"}
    assert await asyncio.to_thread(kube.apply, on_delete, prune) == "unchanged"


async def test_get_and_delete_missing_object(emulator):
    kube = Kube.for_url(str(emulator.url))
    assert await asyncio.to_thread(kube.get, "v1", "Service", "ns", "nope") is None
    assert await asyncio.to_thread(kube.delete, "v1", "Service", "ns", "nope") is False


async def test_create_conflict_raises_409(emulator):
    kube = Kube.for_url(str(emulator.url))
    await asyncio.to_thread(kube.create, service())
    with pytest.raises(KubeError) as err:
        await asyncio.to_thread(kube.create, service())
    assert err.value.status == 409


async def test_list_filters_labels_even_when_the_server_ignores_selectors(emulator):
    kube = Kube.for_url(str(emulator.url))
    for name, labels in [("a", {"app": "x"}), ("b", {"app": "y"})]:
        obj = service()
        obj["metadata"].update(name=name, labels=labels)
        await asyncio.to_thread(kube.create, obj)
    names = [o["metadata"]["name"] for o in await asyncio.to_thread(kube.list, "v1", "Service", "ns", {"app": "x"})]
    assert names == ["a"]


async def test_has_resource_uses_discovery(emulator):
    kube = Kube.for_url(str(emulator.url))
    assert await asyncio.to_thread(kube.has_resource, "apps/v1", "statefulsets")
    assert not await asyncio.to_thread(kube.has_resource, "monitoring.coreos.com/v1", "podmonitors")
