"""KV-cache event streams (proto/cognitora/v1/kv_events.proto, over SSE): an engine's pool,
and cgn-kvcached's RAM and SSD tiers.

The producer (the engine thread, or kvcached's store thread) hands its block
events to `KvEventHub.publish` on the event loop. The hub keeps the set of
block hashes held in each tier and the sequence number it is current to, so
a new subscriber gets a snapshot exactly consistent with the events that
follow it: one `KvSnapshot` per tier the producer has (an engine: device; a
kvcached: ram, then ssd), all with the same `seq`, then events numbered
seq+1, seq+2, ... Every message is a `KvEventEnvelope` in proto3 JSON (hashes
base64), one per SSE `data:` line.

A subscriber that falls more than `max_backlog` messages behind is dropped
(its stream ends); it re-subscribes and starts again from a fresh snapshot,
which is also what it does when it sees a gap in `seq`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from google.protobuf import json_format

from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash
from cgn_proto.cognitora.v1 import kv_events_pb2 as pb

Tier = Literal["device", "ram", "ssd"]
TIERS: dict[Tier, int] = {"device": pb.KV_TIER_DEVICE, "ram": pb.KV_TIER_RAM, "ssd": pb.KV_TIER_SSD}
_KIND = {"stored": pb.KvBlockEvent.STORED, "removed": pb.KvBlockEvent.REMOVED}


@dataclass(frozen=True, slots=True)
class KvEvent:
    seq: int
    kind: Literal["stored", "removed"]
    hashes: tuple[BlockHash, ...]
    tier: Tier = "device"


def encode(envelope: pb.KvEventEnvelope) -> bytes:
    """One SSE message carrying `envelope`."""
    body = json_format.MessageToJson(envelope, indent=None, preserving_proto_field_name=True)
    return b"data: " + body.encode() + b"\n\n"


@dataclass(slots=True, eq=False)
class Subscription:
    queue: asyncio.Queue[bytes | None]
    dropped: bool = False


@dataclass(slots=True)
class KvEventHub:
    namespace: str  # "" for a store that holds several models' blocks
    tiers: tuple[Tier, ...] = ("device",)
    max_backlog: int = 4096
    seq: int = 0
    # per tier, an insertion-ordered set of the block hashes held
    held: dict[Tier, dict[BlockHash, None]] = field(default_factory=dict)
    _subs: set[Subscription] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.held = {t: {} for t in self.tiers}

    def publish(self, events: list[KvEvent]) -> None:
        """Apply and fan out events (on the event loop, in the producer's order)."""
        for ev in events:
            self.seq = ev.seq
            held = self.held.setdefault(ev.tier, {})
            for h in ev.hashes:
                if ev.kind == "stored":
                    held[h] = None
                else:
                    held.pop(h, None)
            msg = encode(
                pb.KvEventEnvelope(
                    event=pb.KvBlockEvent(
                        seq=ev.seq,
                        kind=_KIND[ev.kind],
                        block_hashes=list(ev.hashes),
                        tier=TIERS[ev.tier],
                    )
                )
            )
            for sub in list(self._subs):
                if sub.queue.qsize() >= self.max_backlog:
                    self._drop(sub)
                else:
                    sub.queue.put_nowait(msg)

    def subscribe(self) -> tuple[bytes, Subscription]:
        """The snapshot messages (one per tier) and a subscription to everything after them."""
        out = b""
        for tier, held in self.held.items():
            snapshot = pb.KvSnapshot(
                seq=self.seq,
                block_hashes=list(held),
                tier=TIERS[tier],
                block_size=BLOCK_SIZE,
                namespace=self.namespace,
            )
            out += encode(pb.KvEventEnvelope(snapshot=snapshot))
        sub = Subscription(asyncio.Queue())
        self._subs.add(sub)
        return out, sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def close(self) -> None:
        """End every stream (shutdown)."""
        for sub in list(self._subs):
            self._drop(sub)

    def _drop(self, sub: Subscription) -> None:
        sub.dropped = True
        self._subs.discard(sub)
        sub.queue.put_nowait(None)
