"""The engine's KV-cache event stream (proto/cognitora/v1/kv_events.proto, over SSE).

The engine thread hands each step's block events to `KvEventHub.publish` on
the event loop. The hub keeps the set of block hashes the pool holds and the
sequence number it is current to, so a new subscriber gets a snapshot that is
exactly consistent with the events that follow it. Every message is a
`KvEventEnvelope` in proto3 JSON (hashes base64), one per SSE `data:` line.

A subscriber that falls more than `max_backlog` messages behind is dropped
(its stream ends); it re-subscribes and starts again from a fresh snapshot,
which is also what it does when it sees a gap in `seq`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from google.protobuf import json_format

from cgn_core.blockhash import BLOCK_SIZE, BlockHash
from cgn_infer.block_pool import KvEvent
from cgn_proto.cognitora.v1 import kv_events_pb2 as pb

_KIND = {"stored": pb.KvBlockEvent.STORED, "removed": pb.KvBlockEvent.REMOVED}


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
    namespace: str
    max_backlog: int = 4096
    seq: int = 0
    held: dict[BlockHash, None] = field(default_factory=dict)  # insertion-ordered set
    _subs: set[Subscription] = field(default_factory=set)

    def publish(self, events: list[KvEvent]) -> None:
        """Apply and fan out events (on the event loop, in engine order)."""
        for ev in events:
            self.seq = ev.seq
            for h in ev.hashes:
                if ev.kind == "stored":
                    self.held[h] = None
                else:
                    self.held.pop(h, None)
            msg = encode(
                pb.KvEventEnvelope(
                    event=pb.KvBlockEvent(
                        seq=ev.seq,
                        kind=_KIND[ev.kind],
                        block_hashes=list(ev.hashes),
                        tier=pb.KV_TIER_DEVICE,
                    )
                )
            )
            for sub in list(self._subs):
                if sub.queue.qsize() >= self.max_backlog:
                    self._drop(sub)
                else:
                    sub.queue.put_nowait(msg)

    def subscribe(self) -> tuple[bytes, Subscription]:
        """The snapshot message and a subscription to everything after it."""
        snapshot = pb.KvSnapshot(
            seq=self.seq,
            block_hashes=list(self.held),
            tier=pb.KV_TIER_DEVICE,
            block_size=BLOCK_SIZE,
            namespace=self.namespace,
        )
        sub = Subscription(asyncio.Queue())
        self._subs.add(sub)
        return encode(pb.KvEventEnvelope(snapshot=snapshot)), sub

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
