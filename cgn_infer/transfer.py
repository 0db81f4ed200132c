"""Prefill/decode disaggregation, the engine's side: hold a prefill leg's KV, fetch a decode
leg's (the protocol: cgn_core/kv/transfer.py).

Source (an engine whose role is not decode): a prefill leg runs as any request;
at its end the engine reads the prompt's full blocks out of its pool
(`engine.Exported`) and `TransferSource.hold` puts them in a RAM-only block
store served by the same KvCache gRPC service as cgn-kvcached
(cgn_core/kv), under the engine's layout. The answer's
`kv_transfer_params` names that listener. Blocks are leased:

    hold(prompt A) ─ refs[b] += 1 ─┐        lease_s later ─ refs[b] -= 1 ─ 0: dropped
    hold(prompt B sharing b) ──────┴─ refs[b] = 2 ...      (or sooner: ram_bytes full,
                                                            least recently used first)

Sink (an engine whose role is not prefill): a decode leg fetches the prompt's
full blocks past the pool's own prefix hit from the named source (one
KvCacheClient per source address, kept), within `timeout_s`, and hands them to
the scheduler as a `Restored` whose tier is "peer", the path a restore from
cgn-kvcached takes: one code path and one block format, two transports.
Anything short of every block (unreachable, timeout, blocks gone, another
layout) is a fallback: what is missing is recomputed, the reason is counted
in `cgn_infer_pd_fallbacks_total{reason}` and said in the response's
`x-cgn-kv-transfer` header. Nothing waits longer than `timeout_s`.

Same host: the source offers a private directory in /dev/shm, and a decode
engine that can write there (the same user on the same host; the name is
random, so another host never has it) gets the blocks through a file in it
instead of the gRPC messages. Decoding ~100 MB of messages holds the decode
engine's GIL for most of a second, stalling its running streams; a file is
one copy. `shared_memory = false` turns it off on either side.

Sim backend: its blocks are a few bytes; a fetch sleeps for the time the
modelled engine's blocks would take over a `mb_per_s` link, divided by the
sim's speed, like its compute.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cgn_core.kv import shm
from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash, iter_block_hashes
from cgn_core.kv.client import KvCacheClient, KvCacheError
from cgn_core.kv.layout import Layout
from cgn_core.kv.ram_tier import RamTier
from cgn_core.kv.service import KvCacheService, start_server
from cgn_core.kv.store import BlockStore
from cgn_core.kv.transfer import TransferParams, fallback_note
from cgn_core.settings import TlsSettings
from cgn_infer.block_pool import BlockPool
from cgn_infer.events import Exported
from cgn_infer.metrics import EngineMetrics
from cgn_infer.scheduler import PEER, Restored
from cgn_infer.settings import TransferSettings

log = logging.getLogger(__name__)
SWEEP_S = 1.0  # how often expired leases are dropped
MAX_CLIENTS = 64  # source addresses a decode engine keeps a channel to


class TransferSource:
    """The blocks this engine holds for decode engines, and the listener that serves them."""

    def __init__(self, layout: Layout, settings: TransferSettings, tls: TlsSettings):
        self.layout, self.settings, self.tls = layout, settings, tls
        # NOTE: read-only over gRPC: only this engine stores blocks here, in process
        self.service = KvCacheService(BlockStore(RamTier(settings.ram_bytes)), writable=False)
        self._refs: dict[BlockHash, int] = {}
        self._leases: collections.deque[tuple[float, tuple[BlockHash, ...]]] = collections.deque()
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def holding(self) -> int:
        """Blocks held now for decode engines (until their leases end)."""
        return len(self._refs)

    async def start(self) -> int:
        s = self.settings
        if s.shared_memory:
            self.service.shm_dir = await asyncio.to_thread(shm.make_private)
        self._server, self.port = await start_server(self.service, s.host, s.port, self.tls)
        self._sweeper = asyncio.create_task(self._sweep_forever())
        return self.port

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            await self._server.stop(1.0)
        self.service.events.close()
        if self.service.shm_dir is not None:
            shutil.rmtree(self.service.shm_dir, ignore_errors=True)

    def params(self, exported: Exported, engine_id: str) -> TransferParams:
        """What the prefill leg answers: where the decode engine fetches the blocks."""
        host = self.settings.advertise or self.settings.host
        return TransferParams(
            do_remote_prefill=True,
            remote_host=host,
            remote_port=self.port,
            remote_engine_id=engine_id,
            remote_block_count=len(exported.hashes),
        )

    async def hold(self, exported: Exported, now: float | None = None) -> None:
        """Keep `exported`'s blocks for `lease_s` (on the event loop)."""
        if not exported.hashes:
            return
        await self.service.put_blocks(self.layout, exported.hashes, exported.data)
        for h in exported.hashes:
            self._refs[h] = self._refs.get(h, 0) + 1
        now = time.monotonic() if now is None else now
        self._leases.append((now + self.settings.lease_s, exported.hashes))

    async def hand_over(self, exported: Exported, engine_id: str) -> dict[str, Any]:
        """A prefill leg's end: its blocks held (none: nothing held), and the field its
        answer carries to say where they are."""
        await self.hold(exported)
        return self.params(exported, engine_id).to_json()

    async def sweep(self, now: float) -> int:
        """Drop the blocks of leases ended by `now` that no other lease holds; how many."""
        gone: list[BlockHash] = []
        while self._leases and self._leases[0][0] <= now:
            for h in self._leases.popleft()[1]:
                left = self._refs[h] - 1
                if left:
                    self._refs[h] = left
                else:
                    del self._refs[h]
                    gone.append(h)
        if gone:
            await self.service.discard(self.layout, gone)
        return len(gone)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep(time.monotonic())
            except Exception:  # NOTE: the sweeper must outlive one bad round
                log.exception("dropping expired transfer blocks failed")


@dataclass(frozen=True, slots=True)
class Fetched:
    """A decode leg's fetch: the blocks to restore (None: none), and what happened."""

    restored: Restored | None
    note: str  # the answer's kv_transfer.HEADER: "fetched N blocks[ through shared memory]"
    # or a fallback_note


class TransferSink:
    """Fetches decode legs' blocks from prefill engines (on a restore thread)."""

    def __init__(
        self,
        layout: Layout,
        pool: BlockPool,
        metrics: EngineMetrics,
        settings: TransferSettings,
        tls: TlsSettings,
        *,
        modelled_block_bytes: int | None = None,
        speed: float = 1.0,
    ):
        self.layout, self.pool, self.metrics, self.settings = layout, pool, metrics, settings
        self.tls = tls
        # the sim's blocks stand for bigger ones: sleep out what those would take
        self._modelled = modelled_block_bytes
        self._speed = speed
        self._clients: collections.OrderedDict[str, KvCacheClient] = collections.OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def fetch(
        self, prompt: Sequence[int], params: TransferParams, salt: str | None = None
    ) -> Fetched:
        """The prompt's full blocks past the pool's prefix hit, from the source named in
        `params`; what could not be fetched is recomputed (a fallback, counted). `salt`: the
        request's tenant's (the prefill leg hashed its blocks under it too)."""
        full = (len(prompt) - 1) // BLOCK_SIZE  # the last token is always computed here
        if full == 0:
            return Fetched(None, "nothing to fetch (under one block)")
        hashes = list(iter_block_hashes(prompt[: full * BLOCK_SIZE], self.pool.salted(salt)))
        start = self.pool.cached_prefix_hint(hashes)
        if start >= full:
            return Fetched(None, f"nothing to fetch ({full} blocks cached here)")
        began = time.monotonic()
        client = self._client(params.address)
        try:
            data, tiers = client.get(hashes[start:full])
        except KvCacheError as exc:
            return self._fallback("unreachable", f"{params.address}: {exc}")
        except Exception as exc:  # NOTE: a transfer must never fail the request itself
            log.exception("fetching blocks from %s failed unexpectedly", params.address)
            return self._fallback("error", f"{type(exc).__name__}: {exc}")
        got = len(tiers)
        if self._modelled is not None and got:
            self._model_delay(got, time.monotonic() - began)
        self.metrics.kv_transfer_seconds.observe(time.monotonic() - began)
        self.metrics.kv_transfer_blocks.inc(got)
        restored = Restored(start, data, (PEER,) * got) if got else None
        if start + got < full:
            fallback = self._fallback("missing", f"{got} of {full - start} blocks held")
            return Fetched(restored, fallback.note)
        how = " through shared memory" if client.shared_memory else ""
        return Fetched(restored, f"fetched {got} blocks{how}")

    def _fallback(self, reason: str, detail: str) -> Fetched:
        self.metrics.pd_fallback(reason)
        log.warning("KV transfer fallback (%s): %s; recomputing", reason, detail)
        return Fetched(None, fallback_note(reason))

    def _client(self, address: str) -> KvCacheClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = KvCacheClient(
                    address,
                    self.layout,
                    tls=self.tls if self.tls.enabled else None,
                    timeout_s=self.settings.timeout_s,
                    shared_memory=self.settings.shared_memory,
                )
                self._clients[address] = client
                if len(self._clients) > MAX_CLIENTS:
                    self._clients.popitem(last=False)[1].close()
            self._clients.move_to_end(address)
            return client

    def _model_delay(self, blocks: int, spent: float) -> None:
        assert self._modelled is not None
        want = blocks * self._modelled / (self.settings.mb_per_s * 1e6) / self._speed
        if want > spent:
            time.sleep(want - spent)
