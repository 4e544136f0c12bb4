"""operator/kube.py: the small client, against the API emulator (real HTTP; server-side apply as
tests/operator/emulator.py gives it the real server's semantics)."""

import asyncio

import kmock
import pytest

from emulator import Emulator
from dlo.operator.kube import FIELD_MANAGER, Kube, KubeError, matches


def test_matches_labels_and_dotted_fields():
    obj = {"metadata": {"labels": {"a": "1"}}, "involvedObject": {"name": "p"}, "reason": "FailedMount"}
    assert matches(obj, {"a": "1"}, {"involvedObject.name": "p", "reason": "FailedMount"})
    assert not matches(obj, {"a": "2"})
    assert not matches(obj, fields={"involvedObject.name": "q"})


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
    version = (await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s"))["metadata"]["resourceVersion"]
    assert await asyncio.to_thread(kube.apply, service()) == "unchanged"
    got = await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s")
    assert got["metadata"]["resourceVersion"] == version  # the server wrote nothing
    assert await asyncio.to_thread(kube.apply, service(81)) == "patched"
    got = await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s")
    assert got["spec"]["ports"] == [{"port": 81}]
    applies = [r for r in emulator if r.method.value == "PATCH" and r.resource is not None]
    assert {(r.headers["Content-Type"], r.params.get("fieldManager"), r.params.get("force")) for r in applies} == {
        ("application/apply-patch+yaml", FIELD_MANAGER, "true")}


async def test_apply_removes_a_field_it_no_longer_applies_and_keeps_other_writers_fields(emulator):
    kube = Kube.for_url(str(emulator.url))
    rolling = service()
    rolling["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert await asyncio.to_thread(kube.apply, rolling) == "created"
    # another writer (a person, a controller) adds a label: not the operator's field
    await asyncio.to_thread(kube.patch, "v1", "Service", "ns", "s", {"metadata": {"labels": {"team": "a"}}})
    on_delete = service()
    on_delete["spec"]["strategy"] = {"type": "OnDelete"}
    assert await asyncio.to_thread(kube.apply, on_delete) == "patched"
    got = await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s")
    assert got["spec"]["strategy"] == {"type": "OnDelete"}
    assert got["metadata"]["labels"] == {"team": "a"}
    assert await asyncio.to_thread(kube.apply, on_delete) == "unchanged"


async def test_pod_log_tail_and_a_pod_without_one(emulator):
    kube = Kube.for_url(str(emulator.url))
    emulator.logs[("ns", "p")] = lambda: "one\ntwo\nthree\n"
    assert await asyncio.to_thread(kube.pod_log, "ns", "p", "c", 2) == "two\nthree\n"
    assert await asyncio.to_thread(kube.pod_log, "ns", "other", "c") == ""


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


async def test_delete_with_a_uid_precondition_spares_the_object_that_replaced_the_one_read(emulator):
    kube = Kube.for_url(str(emulator.url))
    read = await asyncio.to_thread(kube.create, service())
    await asyncio.to_thread(kube.delete, "v1", "Service", "ns", "s")
    replaced = await asyncio.to_thread(kube.create, service(81))  # the same name, another object
    assert replaced["metadata"]["uid"] != read["metadata"]["uid"]
    assert await asyncio.to_thread(kube.delete, "v1", "Service", "ns", "s", uid=read["metadata"]["uid"]) is False
    assert (await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s"))["spec"]["ports"] == [{"port": 81}]
    assert await asyncio.to_thread(kube.delete, "v1", "Service", "ns", "s", uid=replaced["metadata"]["uid"]) is True
    assert await asyncio.to_thread(kube.get, "v1", "Service", "ns", "s") is None


async def test_the_recreate_rollout_never_deletes_a_pod_recreated_since_its_list(emulator):
    from dlo.operator.names import TEMPLATE_HASH
    from dlo.operator.reconcile import _delete_old_pods

    kube = Kube.for_url(str(emulator.url))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wan-0", "namespace": "ns",
                                                          "annotations": {TEMPLATE_HASH: "old"}}}
    listed = await asyncio.to_thread(kube.create, pod)  # the list the rollout acts on
    await asyncio.to_thread(kube.delete, "v1", "Pod", "ns", "wan-0")
    await asyncio.to_thread(kube.create, pod)  # the StatefulSet re-created it meanwhile
    assert await asyncio.to_thread(_delete_old_pods, kube, {}, [listed], "new", False) == []
    assert await asyncio.to_thread(kube.get, "v1", "Pod", "ns", "wan-0") is not None  # no restart for a stale read
