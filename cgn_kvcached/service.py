"""The KvCache gRPC service (proto/cognitora/v1/kvcached.proto) over one BlockStore.

Every store operation runs on one worker thread, in order: the store is not
thread-safe and the SSD tier does blocking file I/O, which must not stall the
event loop that streams other clients' blocks. A block being streamed by
`Get` is pinned in RAM until it has been written to the client. Bad input
gets a gRPC status with a message (INVALID_ARGUMENT for a malformed layout or
hash, FAILED_PRECONDITION for a layout nothing was ever stored under), never
a dead server. `Evict` and `Clear` are admin calls: over plaintext they
answer loopback peers only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from cgn_core.http import is_loopback
from cgn_kvcached.layout import BlockKey, Layout, LayoutError
from cgn_kvcached.store import BlockStore
from cgn_proto.cognitora.v1 import kv_events_pb2 as ev_pb
from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc

T = TypeVar("T")
TIERS = {"ram": ev_pb.KV_TIER_RAM, "ssd": ev_pb.KV_TIER_SSD}
MAX_HASHES = 1 << 16  # blocks one request may name (a 1M-token prompt at 16 per block)


class KvCacheService(pb_grpc.KvCacheServicer):  # type: ignore[misc]
    def __init__(self, store: BlockStore, *, tls: bool = False):
        self.store = store
        self.tls = tls
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvcached-store")
        # Layouts blocks were stored under (also those found on the SSD at start).
        self.layouts: set[bytes] = {k.layout for k in store.ram.block_keys()}
        if store.ssd is not None:
            self.layouts |= {k.layout for k in store.ssd.block_keys()}

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # ---- the calls ------------------------------------------------------------------------

    async def Put(self, requests: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutReply:
        layout: bytes | None = None
        stored = dropped = 0
        async for req in requests:
            if layout is None:
                layout = await _layout(req.layout, context)
                self.layouts.add(layout)
            key = await _key(layout, req.block.hash, context)
            if await self._run(self.store.put, key, bytes(req.block.data)):
                stored += 1
            else:
                dropped += 1
        return pb.PutReply(stored=stored, dropped=dropped)

    async def Get(self, req: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetReply]:
        layout = await self._known_layout(req.layout, context)
        keys = [await _key(layout, h, context) for h in await _hashes(req.hashes, context)]
        for key in keys:
            found = await self._run(self._get_pinned, key)
            if found is None:
                return  # a chain stops at its first miss
            data, tier = found
            try:
                yield pb.GetReply(block=pb.KvBlock(hash=key.block, data=data), tier=TIERS[tier])
            finally:
                await self._run(self.store.ram.unpin, key)

    async def Lookup(self, req: pb.LookupRequest, context: Any) -> pb.LookupReply:
        layout = await self._known_layout(req.layout, context)
        keys = [await _key(layout, h, context) for h in await _hashes(req.hashes, context)]
        tiers = await self._run(self.store.lookup, keys)
        return pb.LookupReply(tiers=[TIERS[t] for t in tiers])

    async def Stats(self, req: pb.StatsRequest, context: Any) -> pb.StatsReply:
        return await self._run(self._stats)

    async def Evict(self, req: pb.EvictRequest, context: Any) -> pb.EvictReply:
        await self._admin(context)
        layout = await _layout(req.layout, context)
        keys = [await _key(layout, h, context) for h in await _hashes(req.hashes, context)]
        return pb.EvictReply(evicted=await self._run(self._evict, keys))

    async def Clear(self, req: pb.ClearRequest, context: Any) -> pb.ClearReply:
        await self._admin(context)
        return pb.ClearReply(evicted=await self._run(self._clear))

    # ---- on the store's thread ------------------------------------------------------------

    def _get_pinned(self, key: BlockKey) -> tuple[bytes, str] | None:
        found = self.store.get(key)
        if found is not None:
            self.store.ram.pin(key)  # NOTE: not evicted while it streams (unpin is a no-op
        return found  # for a block RAM could not take: it was read from the SSD file)

    def _evict(self, keys: list[BlockKey]) -> int:
        n = 0
        for key in keys:
            in_ram = self.store.ram.discard(key) is not None
            on_ssd = self.store.ssd.discard(key) if self.store.ssd is not None else False
            n += in_ram or on_ssd
        return n

    def _clear(self) -> int:
        keys = set(self.store.ram.block_keys())
        if self.store.ssd is not None:
            keys |= set(self.store.ssd.block_keys())
        return self._evict(sorted(keys))

    def _stats(self) -> pb.StatsReply:
        s, ram, ssd = self.store, self.store.ram, self.store.ssd
        return pb.StatsReply(
            ram_bytes=ram.used_bytes, ram_budget_bytes=ram.budget_bytes, ram_blocks=len(ram),
            ssd_bytes=ssd.used_bytes if ssd else 0, ssd_budget_bytes=ssd.budget_bytes if ssd else 0,
            ssd_blocks=len(ssd) if ssd else 0, hits_ram=s.stats.hits["ram"],
            hits_ssd=s.stats.hits["ssd"], misses=s.stats.misses,
            checksum_failures=ssd.checksum_failures if ssd else 0, ssd_degraded=s.ssd_degraded,
        )  # fmt: skip

    # ---- checks -----------------------------------------------------------------------------

    async def _known_layout(self, layout: pb.KvLayout, context: Any) -> bytes:
        digest = await _layout(layout, context)
        if digest not in self.layouts:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no block was ever stored under this layout (dtype, layers, KV heads, head dim, "
                "block size and engine must all match the writer's)",
            )
        return digest

    async def _admin(self, context: Any) -> None:
        if self.tls:
            return  # the listener verified a client certificate from the cluster CA
        peer = context.peer() or ""  # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"
        host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]") if ":" in peer else ""
        if not is_loopback(host):
            why = "Evict and Clear over plaintext answer loopback callers only"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


async def _layout(layout: pb.KvLayout, context: Any) -> bytes:
    try:
        return Layout(layout.dtype, layout.layers, layout.kv_heads, layout.head_dim,
                      layout.block_size, layout.engine).digest  # fmt: skip
    except LayoutError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layout: {exc}")
        raise  # not reached: abort raises


async def _key(layout: bytes, block_hash: bytes, context: Any) -> BlockKey:
    if len(block_hash) != 32:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a block hash is 32 bytes, got {len(block_hash)}")  # fmt: skip
    return BlockKey(layout, bytes(block_hash))


async def _hashes(hashes: Any, context: Any) -> list[bytes]:
    if len(hashes) > MAX_HASHES:
        why = f"at most {MAX_HASHES} hashes per request, got {len(hashes)}"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    return list(hashes)
