"""serving/tenants.py: which tenant a key is, what each caller sees of the video store (a job it may
not see reads as one that does not exist), and each tenant's share of the queue."""

from __future__ import annotations

import asyncio
import json

import pytest

from dlo.serving.api_keys import ApiKeyError
from dlo.serving.errors import TenantQueueFull, VideoNotFound
from dlo.serving.tenants import EVERYONE, HeldRequests, Tenants
from dlo.serving.videos import VideoJob, VideoStore

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "ops": "sk-ops"}


def test_each_key_is_its_tenant_and_nothing_else_is_anyone():
    tenants = Tenants(KEYS, admins=("ops",))
    assert [tenants.identify(k.encode()) for k in KEYS.values()] == list(KEYS)
    for wrong in (b"", b"sk-alic", b"sk-alicee", b"SK-ALICE", b"sk-alice "):
        assert tenants.identify(wrong) is None
    alice, ops = tenants.caller("alice", "10.0.0.1"), tenants.caller("ops", "10.0.0.1")
    assert (alice.tenant, alice.admin, alice.holder) == ("alice", False, "alice")  # quotas per tenant
    assert ops.admin and "sk-" not in tenants.describe()
    with pytest.raises(ApiKeyError, match="--admin-key carol: no key of that name"):
        Tenants(KEYS, admins=("carol",))


def test_one_unnamed_key_is_the_default_tenant_who_sees_all_and_quotas_stay_per_address():
    single = Tenants.single("sk-1")
    caller = single.caller(single.identify(b"sk-1"), "10.0.0.9")
    assert (caller.tenant, caller.admin, caller.holder) == ("default", True, "10.0.0.9")
    anyone = Tenants().caller(None, "10.0.0.9")
    assert not Tenants().required and (anyone.tenant, anyone.admin, anyone.holder) == (None, True, "10.0.0.9")


def _job(store: VideoStore, tenant: str | None) -> VideoJob:
    job = store.add(VideoJob(id=store.new_id(), created_at=1, model="tiny", prompt=f"of {tenant}", seconds="1",
                             size="64x64", steps=1, client=tenant, tenant=tenant))
    store.fail(job.id, "x", "finished")
    return job


def test_a_tenant_sees_only_its_own_jobs_and_another_tenants_job_does_not_exist_for_it(tmp_path):
    tenants = Tenants(KEYS, admins=("ops",))
    alice, bob, ops = (tenants.caller(n, "10.0.0.1") for n in ("alice", "bob", "ops"))
    store = VideoStore(tmp_path / "videos", ttl_s=600)
    store.load()
    a, b, legacy = _job(store, "alice"), _job(store, "bob"), _job(store, None)  # legacy: recorded before tenants
    assert [j.id for j in store.list(caller=alice)[0]] == [a.id]
    assert {j.id for j in store.list(caller=ops)[0]} == {a.id, b.id, legacy.id}
    with pytest.raises(VideoNotFound) as hidden:
        store.get(b.id, alice)
    missing = b.id[:-4] + ("0000" if not b.id.endswith("0000") else "1111")
    with pytest.raises(VideoNotFound) as absent:
        store.get(missing, alice)
    assert str(hidden.value).replace(b.id, "ID") == str(absent.value).replace(missing, "ID")  # the same words
    for read in (store.delete, store.content_path, store.open_content):
        with pytest.raises(VideoNotFound):
            read(b.id, alice)
    with pytest.raises(VideoNotFound):
        store.get(legacy.id, bob)
    with pytest.raises(VideoNotFound, match="after="):  # a cursor cannot probe another tenant's ids
        store.list(after=b.id, caller=alice)
    assert b.id in store and store.delete(b.id, ops).id == b.id
    assert json.loads((store.folder / f"{a.id}.json").read_text())["tenant"] == "alice"
    again = VideoStore(tmp_path / "videos", ttl_s=600)
    again.load()  # the owner survives a restart
    assert [j.id for j in again.list(caller=alice)[0]] == [a.id] and again.get(a.id, EVERYONE).tenant == "alice"


def test_a_tenant_at_its_queue_share_is_refused_while_another_is_served():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        tenants = Tenants(KEYS, max_queue=2)
        held = HeldRequests(tenants.max_queue, lambda: 3.2)
        alice, bob = tenants.caller("alice", "10.0.0.1"), tenants.caller("bob", "10.0.0.1")
        futures = [held.submit(alice, loop.create_future) for _ in range(2)]
        with pytest.raises(TenantQueueFull, match="this tenant has 2 requests") as full:
            held.submit(alice, loop.create_future)
        assert full.value.retry_after_s == 4 and full.value.code == "tenant_queue_full"
        held.submit(bob, loop.create_future)  # the same address, another tenant: its own share
        futures[0].set_result(None)  # one finishes ...
        futures[1].cancel()  # ... one is withdrawn (its client left)
        await asyncio.sleep(0)  # done callbacks run on the loop
        assert held.held("alice") == 0
        held.submit(alice, loop.create_future)

    asyncio.run(run())
