"""The asyncio etcd client against a real etcd server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from cgn_core.errors import EtcdUnavailable
from cgn_core.etcd import Compare, EtcdClient, KeyValue, Lease, LeaseNotFound, Op, WatchBatch
from cgn_core.etcd.local import free_port
from cgn_core.settings import EtcdSettings

pytestmark = pytest.mark.etcd


async def until(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    """Poll an async predicate until true; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)


async def test_put_get_prefix_delete(etcd: EtcdClient, prefix: str) -> None:
    rev = await etcd.put(prefix + "b", "2")
    await etcd.put_json(prefix + "a", {"x": 1})
    await etcd.put(prefix.rstrip("/") + "-sibling", "not under the prefix")
    kv = await etcd.get(prefix + "b")
    assert kv is not None and kv.value == b"2" and kv.mod_revision == rev
    assert await etcd.get_json(prefix + "a") == {"x": 1}
    assert await etcd.get(prefix + "missing") is None
    kvs, listing_rev = await etcd.get_prefix(prefix)
    assert [k.key for k in kvs] == [prefix + "a", prefix + "b"] and listing_rev > rev
    assert await etcd.delete(prefix, prefix=True) == 2
    assert (await etcd.get_prefix(prefix))[0] == []


async def test_transactions_and_cas(etcd: EtcdClient, prefix: str) -> None:
    key = prefix + "k"
    assert await etcd.put_if_absent(key, b"first")
    assert not await etcd.put_if_absent(key, b"second")
    kv = await etcd.get(key)
    assert kv is not None and kv.value == b"first"
    assert not await etcd.compare_and_swap(key, b"x", kv.mod_revision - 1)
    assert await etcd.compare_and_swap(key, b"swapped", kv.mod_revision)
    res = await etcd.txn(
        [Compare.value(key, "==", b"swapped")],
        [Op.put(prefix + "other", b"1"), Op.get(prefix, prefix=True)],
        [Op.delete(key)],
    )
    assert res.succeeded
    assert [k.key for k in res.gets[0]] == [prefix + "k", prefix + "other"]
    res = await etcd.txn([Compare.version(key, ">", 5)], [Op.delete(key)], [Op.get(key)])
    assert not res.succeeded and res.gets[0][0].value == b"swapped"


async def test_unreachable_etcd_is_a_clear_error_not_a_hang() -> None:
    port = free_port()
    settings = EtcdSettings(endpoints=(f"127.0.0.1:{port}",), timeout_s=2.0)
    async with EtcdClient(settings) as client:
        start = time.monotonic()
        with pytest.raises(EtcdUnavailable, match=f"etcd unreachable.*127.0.0.1:{port}"):
            await client.get("/x")
        assert time.monotonic() - start < 5


async def test_a_slow_handshake_is_waited_for_not_reported_down(etcd_server) -> None:  # type: ignore[no-untyped-def]
    """etcd answering its first bytes 0.5 s late (a loaded machine, a TLS handshake over a
    slow link) is reachable: the client once gave a connection attempt 100 ms."""
    host, port = etcd_server.endpoint.rsplit(":", 1)
    writers: list[asyncio.StreamWriter] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def slow(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        writers.append(client_w)
        await asyncio.sleep(0.5)
        etcd_r, etcd_w = await asyncio.open_connection(host, int(port))
        writers.append(etcd_w)
        await asyncio.gather(relay(client_r, etcd_w), relay(etcd_r, client_w),
                             return_exceptions=True)  # fmt: skip

    proxy = await asyncio.start_server(slow, "127.0.0.1", 0)
    endpoint = f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    try:
        async with EtcdClient(EtcdSettings(endpoints=(endpoint,))) as client:
            await client.put("/test/slow", "reached")
            kv = await client.get("/test/slow")
    finally:
        proxy.close()
        for w in writers:
            w.close()
        await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
        await proxy.wait_closed()
    assert kv is not None and kv.value == b"reached"


async def test_failover_to_a_live_endpoint(etcd_server) -> None:  # type: ignore[no-untyped-def]
    dead = f"127.0.0.1:{free_port()}"
    async with EtcdClient(EtcdSettings(endpoints=(dead, etcd_server.endpoint))) as client:
        await client.put("/test/failover", "ok")
        kv = await client.get("/test/failover")
        assert kv is not None and kv.value == b"ok"


async def test_lease_expiry_removes_keys(etcd: EtcdClient, prefix: str) -> None:
    lease_id = await etcd.lease_grant(2)
    await etcd.put(prefix + "ephemeral", "v", lease=lease_id)
    assert await etcd.get(prefix + "ephemeral") is not None

    async def gone() -> bool:
        return await etcd.get(prefix + "ephemeral") is None

    await until(gone, 10, "the key to vanish with its lease")
    assert await etcd.lease_ttl(lease_id) == -1
    with pytest.raises(LeaseNotFound):
        await etcd.put(prefix + "late", "v", lease=lease_id)


async def test_keepalive_keeps_keys_and_revoke_removes_them(etcd: EtcdClient, prefix: str) -> None:
    async with Lease(etcd, ttl_s=2) as lease:
        await etcd.put(prefix + "alive", "v", lease=lease.id)
        await asyncio.sleep(4.5)  # more than twice the TTL: only keep-alives explain survival
        assert await etcd.get(prefix + "alive") is not None
        assert not lease.lost.is_set() and not lease.expired_locally
    assert await etcd.get(prefix + "alive") is None  # leaving the block revoked it


async def test_lease_lost_is_reported(etcd: EtcdClient, prefix: str) -> None:
    async with Lease(etcd, ttl_s=5) as lease:
        await etcd.lease_revoke(lease.id)  # someone else revokes it
        await asyncio.wait_for(lease.lost.wait(), 10)


async def collect(
    it: AsyncIterator[WatchBatch],
    out: list[WatchBatch],
    stop_after: int,
    first: asyncio.Event | None = None,
) -> None:
    """Consume batches until `stop_after` events (a resync counts one) have arrived."""
    events = 0
    async for batch in it:
        out.append(batch)
        if first is not None:
            first.set()
        events += len(batch.events) + (1 if batch.resync is not None else 0)
        if events >= stop_after:
            return


async def test_watch_sees_puts_and_deletes_in_order(etcd: EtcdClient, prefix: str) -> None:
    got: list[WatchBatch] = []
    start = await etcd.revision() + 1
    task = asyncio.create_task(collect(etcd.watch_prefix(prefix, start), got, 4))
    await etcd.put(prefix + "a", "1")
    await etcd.txn([], [Op.put(prefix + "b", b"2"), Op.put(prefix + "c", b"3")])
    await etcd.delete(prefix + "a")
    await asyncio.wait_for(task, 10)
    events = [(e.kind, e.kv.key, e.kv.value) for b in got for e in b.events]
    assert events == [
        ("put", prefix + "a", b"1"),
        ("put", prefix + "b", b"2"),
        ("put", prefix + "c", b"3"),
        ("delete", prefix + "a", b""),
    ]
    revs = [e.kv.mod_revision for b in got for e in b.events]
    assert revs[0] < revs[1] == revs[2] < revs[3]  # the transaction's puts share a revision
    assert all(b.revision == b.events[-1].kv.mod_revision for b in got)


async def test_watch_from_a_compacted_revision_resyncs(etcd: EtcdClient, prefix: str) -> None:
    first = await etcd.put(prefix + "a", "1")
    await etcd.put(prefix + "a", "2")
    await etcd.put(prefix + "b", "1")
    await etcd.compact(await etcd.revision())
    got: list[WatchBatch] = []
    resynced = asyncio.Event()
    task = asyncio.create_task(collect(etcd.watch_prefix(prefix, first), got, 2, resynced))
    await asyncio.wait_for(resynced.wait(), 10)
    await etcd.put(prefix + "c", "after")
    await asyncio.wait_for(task, 10)
    resync = got[0].resync
    assert resync is not None
    assert [(kv.key, kv.value) for kv in resync] == [(prefix + "a", b"2"), (prefix + "b", b"1")]
    assert [(e.kind, e.kv.key) for e in got[1].events] == [("put", prefix + "c")]


def test_key_value_json() -> None:
    kv = KeyValue("/k", b'{"a": [1]}', 1, 1, 1, 0)
    assert kv.json() == {"a": [1]}
