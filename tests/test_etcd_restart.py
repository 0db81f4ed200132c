"""Clients, watches, leases and elections across a real etcd restart and a leader hand-over."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cgn_core.errors import EtcdUnavailable
from cgn_core.etcd import Election, EtcdClient, Lease, WatchBatch
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    """A private etcd this test may stop and restart (same ports, same data)."""
    server = LocalEtcd(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


def settings(server: LocalEtcd) -> EtcdSettings:
    return EtcdSettings(endpoints=(server.endpoint,), timeout_s=2.0)


async def restart(server: LocalEtcd) -> None:
    await asyncio.to_thread(server.stop)
    await asyncio.to_thread(server.start)


async def test_watch_survives_restart_without_loss_or_duplicates(own_etcd: LocalEtcd) -> None:
    seen: list[str] = []
    async with EtcdClient(settings(own_etcd)) as writer, EtcdClient(settings(own_etcd)) as watcher:

        async def consume(watched: AsyncIterator[WatchBatch]) -> None:
            async for batch in watched:
                seen.extend(f"{e.kind}:{e.kv.key}={e.kv.value.decode()}" for e in batch.events)
                assert batch.resync is None
                if len(seen) >= 6:
                    return

        # Watch from a known revision: no write is missed, however late the watch registers.
        await writer.put("/w/0", "seed")
        seed = await writer.get("/w/0")
        assert seed is not None
        watched = watcher.watch_prefix("/w/", start_revision=seed.mod_revision + 1)
        task = asyncio.create_task(consume(watched))
        await writer.put("/w/1", "a")
        await writer.put("/w/2", "b")
        await _until(lambda: len(seen) >= 2, 10)
        await restart(own_etcd)
        # Written while the watcher is still reconnecting: must be replayed, once each.
        await writer.put("/w/3", "c")
        await writer.put("/w/1", "a2")
        await writer.delete("/w/2")
        await writer.put("/w/4", "d")
        await asyncio.wait_for(task, 30)
    assert seen == [
        "put:/w/1=a",
        "put:/w/2=b",
        "put:/w/3=c",
        "put:/w/1=a2",
        "delete:/w/2=",
        "put:/w/4=d",
    ]


async def test_client_calls_recover_after_restart(own_etcd: LocalEtcd) -> None:
    """A daemon's client fails fast while etcd is down; a patient one (cgn-ctl's) waits out
    a restart within its deadline instead of reporting etcd down."""
    patient = EtcdSettings(endpoints=(own_etcd.endpoint,), timeout_s=30.0)
    async with EtcdClient(settings(own_etcd)) as client, EtcdClient(patient, patient=True) as ctl:
        await client.put("/r/k", "before")
        await asyncio.to_thread(own_etcd.stop)
        with pytest.raises(EtcdUnavailable, match="etcd unreachable"):
            await client.get("/r/k")
        starting = asyncio.create_task(asyncio.to_thread(own_etcd.start))
        kv = await ctl.get("/r/k")
        await starting
        assert kv is not None and kv.value == b"before"
        deadline = time.monotonic() + 15
        while True:
            try:
                kv = await client.get("/r/k")
                break
            except EtcdUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert kv is not None and kv.value == b"before"


async def test_keepalive_survives_restart(own_etcd: LocalEtcd) -> None:
    async with EtcdClient(settings(own_etcd)) as client, Lease(client, ttl_s=3) as lease:
        await client.put("/l/k", "v", lease=lease.id)
        await restart(own_etcd)
        await asyncio.sleep(5)  # beyond the TTL: the key lives only if keep-alive reconnected
        assert not lease.lost.is_set()
        assert await client.get("/l/k") is not None
        assert await client.lease_ttl(lease.id) > 0


async def test_leader_election_hands_over(own_etcd: LocalEtcd) -> None:
    async with (
        EtcdClient(settings(own_etcd)) as ca,
        EtcdClient(settings(own_etcd)) as cb,
        Election(ca, "test", "router-a", ttl_s=5) as a,
        Election(cb, "test", "router-b", ttl_s=5) as b,
    ):
        await asyncio.wait_for(a.campaign(), 10)
        assert a.leading and await b.leader() == "router-a"
        b_task = asyncio.create_task(b.campaign())
        await asyncio.sleep(0.5)
        assert not b_task.done() and not b.leading  # one leader at a time
        # The leader dies: its lease is revoked (as etcd does when it expires).
        await ca.lease_revoke(a.lease.id)
        await asyncio.wait_for(b_task, 10)
        assert b.leading and await a.leader() == "router-b"
        await asyncio.wait_for(a.lost.wait(), 10)
        assert not a.leading
        # A clean resignation hands over too.
        a2 = Election(ca, "test", "router-a2", ttl_s=5)
        a2_task = asyncio.create_task(a2.campaign())
        await b.resign()
        await asyncio.wait_for(a2_task, 10)
        assert a2.leading and await a2.leader() == "router-a2"
        await a2.resign()
        assert await a2.leader() is None


async def _until(cond, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        await asyncio.sleep(0.02)
