"""The router's KV-event followers: one task per stream, feeding the prefix and tier indexes.

Two kinds of stream, one format (`cognitora.v1.KvEventEnvelope` as SSE):

* an engine's pool (`kv_events_url` of an endpoint that publishes events),
  applied to `PrefixIndex` under the endpoint's id;
* a node's cgn-kvcached (its RAM and SSD tiers, `kvcached:<node>` in the
  metrics), applied to `TierIndex` under the node.

A snapshot must match the block-hash contract (docs/architecture.md): blocks
of `BLOCK_SIZE` tokens and the namespace the router hashes prompts in (the
endpoint's model; "" for a store, which holds several models' blocks).
Hashes from another block size or namespace can never equal the router's, so
such a stream is refused (logged once, counted in
`cgn_router_kv_streams_refused_total`) and retried with backoff, in case the
engine is replaced by one that matches. A gap in `seq` or a broken stream
keeps the last known set and reconnects for a fresh snapshot.

    reconcile() ── wanted streams (registry endpoints + stores) vs running tasks:
       │            start the new, cancel the gone or changed
       │            (reconcile(eid): that endpoint's stream only, for one etcd event)
       └ _follow(stream) ── GET events ─ snapshot ─ events… ─┐
              ^                                            gap / error / refused
              └──────────────── backoff 0.2 s … 5 s ──────────┘
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from google.protobuf import json_format

from cgn_core.backoff import Backoff
from cgn_core.http import bearer_header
from cgn_core.kv.blockhash import BLOCK_SIZE, namespace
from cgn_proto.cognitora.v1 import kv_events_pb2 as pb
from cgn_router.routing.kv_index import RAM, SSD, PrefixIndex, TierIndex
from cgn_router.service import RouterService
from cgn_router.types import EndpointId

log = logging.getLogger(__name__)
STORE = "kvcached:"  # the metrics label of a node's KV store stream: kvcached:<node>
_TIER_BITS = {pb.KV_TIER_RAM: RAM, pb.KV_TIER_SSD: SSD}


class StreamRefused(ValueError):
    """A stream whose snapshot breaks the block-hash contract."""


@dataclass(frozen=True, slots=True)
class Stream:
    """One followed stream: an engine's pool (`node` None) or a node's store (`eid` "")."""

    eid: str
    node: str | None
    url: str
    token: str
    namespace: str  # what its snapshot must name

    @property
    def label(self) -> str:
        return self.eid if self.node is None else STORE + self.node


def check_snapshot(snap: pb.KvSnapshot, ns: str) -> None:
    """StreamRefused unless `snap` uses the router's block size and namespace `ns`."""
    if snap.block_size != BLOCK_SIZE:
        raise StreamRefused(f"blocks of {snap.block_size} tokens, the router hashes {BLOCK_SIZE}")
    if snap.namespace != ns:
        raise StreamRefused(f"hash namespace {snap.namespace!r}, the router expects {ns!r}")


def apply_pool(index: PrefixIndex, eid: EndpointId, ns: str, msg: pb.KvEventEnvelope) -> bool:
    """An engine's message; False on a gap (resync needed)."""
    if msg.HasField("snapshot"):
        check_snapshot(msg.snapshot, ns)
        index.snapshot(eid, msg.snapshot.seq, msg.snapshot.block_hashes)
        return True
    ev = msg.event
    return index.event(eid, ev.seq, ev.kind == pb.KvBlockEvent.STORED, ev.block_hashes)


def apply_tiers(tiers: TierIndex, node: str, msg: pb.KvEventEnvelope, first: bool) -> bool:
    """A node store's message; events of tiers other than RAM and SSD are skipped."""
    if msg.HasField("snapshot"):
        snap = msg.snapshot
        check_snapshot(snap, "")
        bits = _TIER_BITS.get(snap.tier, 0)
        tiers.snapshot(node, snap.seq, bits, snap.block_hashes if bits else (), first)
        return True
    ev = msg.event
    bits = _TIER_BITS.get(ev.tier, 0)
    stored = ev.kind == pb.KvBlockEvent.STORED
    return tiers.event(node, ev.seq, stored, bits, ev.block_hashes if bits else ())


class KvFollowers:
    """The running follower tasks, one per wanted stream (see the module docstring)."""

    def __init__(self, svc: RouterService, session: aiohttp.ClientSession, tg: asyncio.TaskGroup):
        self.svc, self.session, self.tg = svc, session, tg
        self.tasks: dict[tuple[str, str | None], tuple[Stream, asyncio.Task[None]]] = {}

    def wanted(self) -> dict[tuple[str, str | None], Stream]:
        reg = self.svc.registry
        out: dict[tuple[str, str | None], Stream] = {
            (eid, None): stream for eid in reg.states if (stream := self._pool_stream(eid))
        }
        for node, (url, token) in reg.stores.items():
            out["", node] = Stream("", node, url, token, "")
        return out

    def _pool_stream(self, eid: EndpointId) -> Stream | None:
        """The stream endpoint `eid` should be followed on; None for none (or no endpoint)."""
        state = self.svc.registry.states.get(eid)
        if state is None or not (ep := state.endpoint).kv_events_url:
            return None
        return Stream(eid, None, ep.kv_events_url, ep.token, namespace(ep.model))

    def reconcile(self, changed: EndpointId | None = None) -> None:
        """Start, restart or stop follower tasks to match the registry: every stream, or only
        endpoint `changed`'s (an etcd event about one endpoint costs O(1), not O(fleet))."""
        if changed is not None:
            self._set((changed, None), self._pool_stream(changed))
            return
        want = self.wanted()
        for key in list(self.tasks):
            if key not in want:
                self._set(key, None)
        for key, stream in want.items():
            self._set(key, stream)

    def _set(self, key: tuple[str, str | None], stream: Stream | None) -> None:
        have = self.tasks.get(key)
        if have is not None and have[0] == stream:
            return
        if have is not None:
            have[1].cancel()
            del self.tasks[key]
        if stream is not None:
            self.tasks[key] = (stream, self.tg.create_task(self._follow(stream)))

    async def _follow(self, stream: Stream) -> None:
        reg, metrics = self.svc.registry, self.svc.metrics
        backoff = Backoff(base=0.2, cap=5.0)
        refused = ""  # the last refusal logged, so a misconfigured engine logs once
        while True:
            try:
                await self._read(stream, backoff)
            except StreamRefused as exc:
                metrics.kv_refused.labels(stream.label).inc()
                if str(exc) != refused:
                    refused = str(exc)
                    log.warning("KV events of %s refused: %s", stream.label, exc)
            except (aiohttp.ClientError, json_format.ParseError, ValueError, TimeoutError) as exc:
                log.debug("KV events of %s: %s", stream.label, exc)
            except Exception:  # NOTE: a peer's stream must never end the router's TaskGroup
                log.exception("KV events of %s: unexpected failure; reconnecting", stream.label)
            if stream.node is None:
                reg.index.lost(EndpointId(stream.eid))
            await asyncio.sleep(backoff.next())

    async def _read(self, stream: Stream, backoff: Backoff) -> None:
        """Follow one connection until it ends or shows a gap."""
        reg, metrics = self.svc.registry, self.svc.metrics
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.svc.settings.deadlines.connect_s, sock_read=None
        )
        first = True
        async with self.session.get(
            stream.url, timeout=timeout, read_bufsize=1 << 24, headers=bearer_header(stream.token)
        ) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                msg = json_format.Parse(line[6:], pb.KvEventEnvelope(), ignore_unknown_fields=True)
                if stream.node is None:
                    eid = EndpointId(stream.eid)
                    applied = apply_pool(reg.index, eid, stream.namespace, msg)
                else:
                    applied = apply_tiers(reg.tiers, stream.node, msg, first)
                if not applied:
                    return  # a gap: reconnect for a fresh snapshot
                if msg.HasField("snapshot"):
                    if first:
                        metrics.kv_resyncs.labels(stream.label).inc()
                    first = False
                    backoff.reset()
                else:
                    metrics.kv_events.labels(stream.label).inc()
