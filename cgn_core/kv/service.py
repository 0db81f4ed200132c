"""The KvCache gRPC service (proto/cognitora/v1/kvcached.proto) over one BlockStore.

Every store operation runs on one worker thread, in order: the store is not
thread-safe and the SSD tier does blocking file I/O, which must not stall the
event loop that streams other clients' blocks. A block being streamed by
`Get` is pinned in RAM until it has been written to the client. Bad input
gets a gRPC status with a message (INVALID_ARGUMENT for a malformed layout or
hash), never a dead server. A layout nothing was stored under is answered
like any other miss (an empty chain): the store says nothing about layouts it
holds to a caller who does not name one.

Who may call (cgn_core/kv/identity.py): with the node's keys, Put, Get,
Lookup and Stats need the client token (what the node's engines hold) and
Evict and Clear the admin token; a wrong or missing one is UNAUTHENTICATED or
PERMISSION_DENIED before anything is read. Without keys (a development store;
logged at start) the client calls are open and the admin calls refused. A
read-only service (a prefill engine's transfer listener) refuses Put, Evict
and Clear from everyone: only its owner stores blocks, in process.

Shared memory: a same-node client may move a call's bytes through a file it
made in `shm_dir` (a tmpfs) instead of the messages, which is what makes a
restore fast enough to pay (the Python gRPC path alone moves ~250 MB/s,
bench/results/kvcached_tiers.md). The server only ever opens an existing
regular file directly inside `shm_dir` (no symlinks, no other directory,
never blocking on a FIFO), never creates, grows or removes one, and checks
its type and size before any read or write.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from cgn_core.errors import ConfigError
from cgn_core.kv.blockhash import BlockHash
from cgn_core.kv.events import KvEventHub
from cgn_core.kv.identity import StoreKeys, presented, same
from cgn_core.kv.layout import BlockKey, Layout, LayoutError
from cgn_core.kv.store import BlockStore
from cgn_core.settings import TlsSettings
from cgn_core.tls import NodeIdentityInterceptor, server_credentials, warn_if_plaintext
from cgn_core.tracing import Tracer
from cgn_proto.cognitora.v1 import kv_events_pb2 as ev_pb
from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc

T = TypeVar("T")
log = logging.getLogger(__name__)
TIERS = {"ram": ev_pb.KV_TIER_RAM, "ssd": ev_pb.KV_TIER_SSD}
MAX_HASHES = 1 << 16  # blocks one request may name (a 1M-token prompt at 16 per block)
PUT_BATCH = 64  # blocks stored per hop to the store's thread (at least)
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class ShmRefused(ValueError):
    """A shared-memory file the server will not use; the message says why."""


class KvCacheService(pb_grpc.KvCacheServicer):  # type: ignore[misc]
    def __init__(
        self,
        store: BlockStore,
        *,
        shm_dir: Path | None = None,
        keys: StoreKeys | None = None,
        writable: bool = True,
        tracer: Tracer | None = None,
    ):
        """`tracer`: spans for Get and Put (cgn_core/tracing.py); None: tracing off."""
        self.tracer = tracer
        self.store = store
        self.shm_dir = shm_dir
        self.keys = keys
        self.writable = writable
        # What each tier holds, for routers (served as SSE by the admin listener).
        self.events = KvEventHub("", ("ram", "ssd"))
        for tier, hashes in store.held().items():
            self.events.held[tier] = dict.fromkeys(BlockHash(h) for h in hashes)
        store.drain_events()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvcached-store")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn` on the store's thread; the tier changes it made go to the event hub, in order."""
        loop = asyncio.get_running_loop()

        def call() -> T:
            try:
                return fn(*args)
            finally:
                if events := self.store.drain_events():
                    loop.call_soon_threadsafe(self.events.publish, events)

        return await loop.run_in_executor(self._worker, call)

    # ---- for the process that owns the store (an engine holding blocks for a transfer) -------

    async def put_blocks(self, layout: Layout, hashes: Sequence[bytes], rows: Any) -> int:
        """Store blocks (`rows[i]`: block i's bytes) under `layout`; how many were stored."""
        batch: list[tuple[BlockKey, bytes | int]] = [
            (BlockKey(layout.digest, bytes(h)), bytes(row))
            for h, row in zip(hashes, rows, strict=True)
        ]
        return await self._run(self._put_many, batch, None, layout.block_bytes)

    async def discard(self, layout: Layout, hashes: Sequence[bytes]) -> int:
        """Drop these blocks of `layout` wherever they are; how many were held."""
        return await self._run(self._evict, [BlockKey(layout.digest, bytes(h)) for h in hashes])

    # ---- the calls ------------------------------------------------------------------------

    async def Put(self, requests: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutReply:
        span = _span(self.tracer, "kv put", context)  # an offer is a trace of its own
        await self._caller(context, writes=True)
        layout: Layout | None = None
        shm: int | None = None
        batch: list[tuple[BlockKey, bytes | int]] = []  # data, or its offset in the shared file
        stored = dropped = 0
        try:
            async for req in requests:
                if layout is None:
                    layout = await _layout(req.layout, context)
                    if req.shm_path:
                        shm = await self._shm_open(req.shm_path, os.O_RDONLY, 0, context)
                blocks = [req.block] if req.HasField("block") else []
                for block in [*blocks, *req.blocks]:
                    key = await _key(layout.digest, block.hash, context)
                    if shm is not None:
                        batch.append((key, block.shm_offset))
                    elif len(block.data) != layout.block_bytes:
                        got = len(block.data)
                        why = f"a block of this layout is {layout.block_bytes} bytes, got {got}"
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
                    else:
                        batch.append((key, bytes(block.data)))
                if len(batch) >= PUT_BATCH:
                    n = await self._put_batch(batch, shm, layout, context)
                    stored, dropped, batch = stored + n, dropped + len(batch) - n, []
            if batch and layout is not None:
                n = await self._put_batch(batch, shm, layout, context)
                stored, dropped = stored + n, dropped + len(batch) - n
        finally:
            if span is not None:
                size = layout.block_bytes if layout is not None else 0
                span.set_attributes(
                    {
                        "cognitora.kv.blocks_stored": stored,
                        "cognitora.kv.blocks_dropped": dropped,
                        "cognitora.kv.bytes": stored * size,
                        "cognitora.kv.shared_memory": shm is not None,
                    }
                )
                span.end()
            if shm is not None:
                os.close(shm)
        return pb.PutReply(stored=stored, dropped=dropped)

    async def _put_batch(
        self,
        batch: list[tuple[BlockKey, bytes | int]],
        shm: int | None,
        layout: Layout,
        context: Any,
    ) -> int:
        try:
            return await self._run(self._put_many, batch, shm, layout.block_bytes)
        except ShmRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # not reached: abort raises

    async def Get(self, req: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetReply]:
        span = _span(self.tracer, "kv get", context)
        served = _Served(shared_memory=bool(req.shm_path))
        try:
            async for reply in self._get(req, context, served):
                yield reply
        finally:
            if span is not None:
                span.set_attributes(served.attributes(asked=len(req.hashes)))
                span.end()

    async def _get(
        self, req: pb.GetRequest, context: Any, served: _Served
    ) -> AsyncIterator[pb.GetReply]:
        await self._caller(context)
        layout = await _layout(req.layout, context)
        served.block_bytes = layout.block_bytes
        keys = [await _key(layout.digest, h, context) for h in await _hashes(req.hashes, context)]
        if req.shm_path:
            size = len(keys) * layout.block_bytes
            shm = await self._shm_open(req.shm_path, os.O_RDWR, size, context)
            try:
                tiers = await self._run(self._get_into, shm, keys, layout.block_bytes)
            finally:
                os.close(shm)
            blocks = [
                pb.KvBlock(hash=key.block, shm_offset=i * layout.block_bytes)
                for i, key in enumerate(keys[: len(tiers)])
            ]
            served.tiers += tiers
            if blocks:
                yield pb.GetReply(blocks=blocks, tiers=[TIERS[t] for t in tiers])
            return
        for key in keys:
            found = await self._run(self._get_pinned, key)
            if found is None:
                return  # a chain stops at its first miss
            data, tier = found
            served.tiers.append(tier)
            try:
                yield pb.GetReply(block=pb.KvBlock(hash=key.block, data=data), tier=TIERS[tier])
            finally:
                await self._run(self.store.ram.unpin, key)

    async def Lookup(self, req: pb.LookupRequest, context: Any) -> pb.LookupReply:
        await self._caller(context)
        layout = await _layout(req.layout, context)
        keys = [await _key(layout.digest, h, context) for h in await _hashes(req.hashes, context)]
        tiers = await self._run(self.store.lookup, keys)
        return pb.LookupReply(tiers=[TIERS[t] for t in tiers])

    async def Stats(self, req: pb.StatsRequest, context: Any) -> pb.StatsReply:
        await self._caller(context)
        return await self._run(self._stats)

    async def Evict(self, req: pb.EvictRequest, context: Any) -> pb.EvictReply:
        await self._caller(context, writes=True, admin=True)
        layout = await _layout(req.layout, context)
        keys = [await _key(layout.digest, h, context) for h in await _hashes(req.hashes, context)]
        return pb.EvictReply(evicted=await self._run(self._evict, keys))

    async def Clear(self, req: pb.ClearRequest, context: Any) -> pb.ClearReply:
        await self._caller(context, writes=True, admin=True)
        return pb.ClearReply(evicted=await self._run(self._clear))

    # ---- on the store's thread ------------------------------------------------------------

    def _get_pinned(self, key: BlockKey) -> tuple[bytes, str] | None:
        found = self.store.get(key)
        if found is not None:
            self.store.ram.pin(key)  # NOTE: not evicted while it streams (unpin is a no-op
        return found  # for a block RAM could not take: it was read from the SSD file)

    def _get_into(self, fd: int, keys: list[BlockKey], block_bytes: int) -> list[str]:
        """Write the chain's blocks into the shared file, block i at i * block_bytes, up to
        the first miss; the tier of each. One call on this thread: no pins needed."""
        tiers: list[str] = []
        for i, key in enumerate(keys):
            found = self.store.get(key)
            if found is None:
                break
            os.pwrite(fd, found[0], i * block_bytes)
            tiers.append(found[1])
        return tiers

    def _put_many(
        self, batch: list[tuple[BlockKey, bytes | int]], shm: int | None, block_bytes: int
    ) -> int:
        """Store a batch of blocks (their bytes, or offsets in the shared file); how many
        were stored. One call on this thread per batch, not one per block."""
        stored = 0
        for key, where in batch:
            if isinstance(where, int):
                assert shm is not None
                data = os.pread(shm, block_bytes, where)
                if len(data) != block_bytes:
                    raise ShmRefused("a block's shm_offset lies past the end of shm_path")
            else:
                data = where
            stored += self.store.put(key, data)
        return stored

    def _shm_check(self, path: str, flags: int, size: int) -> int:
        """Open the client's shared file; ShmRefused unless it is safe and large enough."""
        if self.shm_dir is None:
            raise ShmRefused("this server offers no shared memory (shm_dir is unset)")
        p = Path(path)
        if p.parent != self.shm_dir or not _SHM_NAME.fullmatch(p.name):
            raise ShmRefused(f"shm_path must be a plain file name directly in {self.shm_dir}")
        try:
            fd = os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
        except OSError as exc:
            raise ShmRefused(f"shm_path {path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            os.close(fd)
            raise ShmRefused(f"shm_path must be a regular file of at least {size} bytes")
        return fd

    def _evict(self, keys: list[BlockKey]) -> int:
        return sum(self.store.discard(key) for key in keys)

    def _clear(self) -> int:
        keys = set(self.store.ram.block_keys())
        if self.store.ssd is not None:
            keys |= set(self.store.ssd.block_keys())
        return self._evict(sorted(keys))

    def _stats(self) -> pb.StatsReply:
        s, ram, ssd = self.store, self.store.ram, self.store.ssd
        return pb.StatsReply(
            ram_bytes=ram.used_bytes,
            ram_budget_bytes=ram.budget_bytes,
            ram_blocks=len(ram),
            ssd_bytes=ssd.used_bytes if ssd else 0,
            ssd_budget_bytes=ssd.budget_bytes if ssd else 0,
            ssd_blocks=len(ssd) if ssd else 0,
            hits_ram=s.stats.hits["ram"],
            hits_ssd=s.stats.hits["ssd"],
            misses=s.stats.misses,
            checksum_failures=ssd.checksum_failures if ssd else 0,
            ssd_degraded=s.ssd_degraded,
            shm_dir=str(self.shm_dir or ""),
        )

    # ---- checks -----------------------------------------------------------------------------

    async def _shm_open(self, path: str, flags: int, size: int, context: Any) -> int:
        try:
            return await self._run(self._shm_check, path, flags, size)
        except ShmRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # not reached: abort raises

    async def _caller(self, context: Any, *, writes: bool = False, admin: bool = False) -> None:
        """Abort the call unless its caller may make it (see the module's docstring)."""
        if writes and not self.writable:
            why = "this listener is read-only: it serves a prefill engine's blocks"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        if self.keys is None:
            if admin:
                why = "Evict and Clear need the admin token: this store runs without secret_file"
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return
        token = presented(context.invocation_metadata())
        if same(token, self.keys.admin_token):
            return
        if not token:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this store needs a bearer token")
        if admin or not same(token, self.keys.client_token):
            why = "the admin token" if admin else "the node's client token"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"this call needs {why}")


async def start_server(
    service: KvCacheService, host: str, port: int, tls: TlsSettings
) -> tuple[grpc.aio.Server, int]:
    """`service` listening on host:port (0: any free port), with mutual TLS and the
    node-identity check when `tls` is enabled, plaintext (logged) otherwise; returns the
    started server and its port. ConfigError when the address cannot be bound."""
    # NOTE: with TLS every call needs a client certificate of the cluster CA, and one that
    # claims a node id (x-cgn-node) must carry that id as its CN
    server = grpc.aio.server(interceptors=[NodeIdentityInterceptor()] if tls.enabled else [])
    pb_grpc.add_KvCacheServicer_to_server(service, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls.enabled:
            bound = server.add_secure_port(address, server_credentials(tls))
        else:
            warn_if_plaintext(log, f"KV gRPC listener {address}", tls)
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc}") from None
    if bound == 0:
        raise ConfigError(f"cannot listen on {address}")
    await server.start()
    return server, bound


@dataclass(slots=True)
class _Served:
    """What a Get sent, for its span."""

    shared_memory: bool
    tiers: list[str] = field(default_factory=list)  # of each block sent
    block_bytes: int = 0

    def attributes(self, asked: int) -> dict[str, Any]:
        return {
            "cognitora.kv.blocks_asked": asked,
            "cognitora.kv.blocks_found": len(self.tiers),
            "cognitora.kv.blocks_ram": self.tiers.count("ram"),
            "cognitora.kv.blocks_ssd": self.tiers.count("ssd"),
            "cognitora.kv.bytes": len(self.tiers) * self.block_bytes,
            "cognitora.kv.shared_memory": self.shared_memory,
        }


def _span(tracer: Tracer | None, name: str, context: Any) -> Any:
    """A SERVER span for a call, continuing the caller's trace from its metadata; None when
    tracing is off or the trace is not sampled."""
    if tracer is None:
        return None
    incoming = tracer.incoming(dict(context.invocation_metadata() or ()))
    if not incoming.sampled:
        return None
    return tracer.start(name, incoming.context, kind="server")


async def _layout(layout: pb.KvLayout, context: Any) -> Layout:
    try:
        return Layout(
            layout.dtype,
            layout.layers,
            layout.kv_heads,
            layout.head_dim,
            layout.block_size,
            layout.engine,
        )
    except LayoutError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layout: {exc}")
        raise  # not reached: abort raises


async def _key(layout: bytes, block_hash: bytes, context: Any) -> BlockKey:
    if len(block_hash) != 32:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"a block hash is 32 bytes, got {len(block_hash)}"
        )
    return BlockKey(layout, bytes(block_hash))


async def _hashes(hashes: Any, context: Any) -> list[bytes]:
    if len(hashes) > MAX_HASHES:
        why = f"at most {MAX_HASHES} hashes per request, got {len(hashes)}"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    return list(hashes)
