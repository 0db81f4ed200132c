"""Where KV blocks live: per endpoint, exact from KV events or approximate.

Exact: an engine that streams KV events (cgn-infer) sends a snapshot and then
STORED/REMOVED events numbered seq+1, seq+2, ...; the index mirrors its block
set and reports a gap (a missed event) so the subscriber resyncs from a fresh
snapshot.

Approximate: for engines without events, the blocks of each request routed
to an endpoint are assumed cached there for `approx_ttl_s`, at most
`approx_blocks` per endpoint, least recently used evicted first. Event-fed
endpoints get the same treatment for `optimistic_ttl_s`, bridging the time
between routing a request and its STORED event.

match() is the longest run of leading prompt blocks an endpoint holds.

Node tiers (`TierIndex`): each node's cgn-kvcached streams what its RAM and
SSD tiers hold (one snapshot per tier, then events carrying their tier), so
`extend()` says how many more of a prompt's blocks, past what an engine's own
pool holds, that engine's node could restore, and from which tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cgn_core.blockhash import BlockHash
from cgn_router.types import EndpointId


@dataclass(slots=True)
class _Blocks:
    exact: set[BlockHash] = field(default_factory=set)
    seq: int | None = None  # None: no snapshot yet (or lost); exact set not trusted
    assumed: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)  # → expiry


class PrefixIndex:
    def __init__(self, approx_ttl_s: float, approx_blocks: int, optimistic_ttl_s: float):
        self.approx_ttl_s = approx_ttl_s
        self.approx_blocks = approx_blocks
        self.optimistic_ttl_s = optimistic_ttl_s
        self._by_endpoint: dict[EndpointId, _Blocks] = {}

    def _get(self, eid: EndpointId) -> _Blocks:
        blocks = self._by_endpoint.get(eid)
        if blocks is None:
            blocks = self._by_endpoint[eid] = _Blocks()
        return blocks

    def match(self, eid: EndpointId, hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading `hashes` the endpoint holds."""
        blocks = self._by_endpoint.get(eid)
        if blocks is None:
            return 0
        exact, assumed = blocks.exact, blocks.assumed
        n = 0
        for h in hashes:
            if h in exact:
                n += 1
                continue
            expiry = assumed.get(h)
            if expiry is None or expiry <= now:
                break
            n += 1
        return n

    def exact_size(self, eid: EndpointId) -> int:
        blocks = self._by_endpoint.get(eid)
        return len(blocks.exact) if blocks else 0

    def assumed_size(self, eid: EndpointId) -> int:
        blocks = self._by_endpoint.get(eid)
        return len(blocks.assumed) if blocks else 0

    def routed(
        self, eid: EndpointId, hashes: Sequence[BlockHash], now: float, *, exact: bool
    ) -> None:
        """A request with `hashes` was sent to `eid`: assume its blocks cached there."""
        blocks = self._get(eid)
        ttl = self.optimistic_ttl_s if exact else self.approx_ttl_s
        assumed = blocks.assumed
        for h in hashes:
            if h in blocks.exact:
                continue
            assumed[h] = now + ttl
            assumed.move_to_end(h)
        while len(assumed) > self.approx_blocks:
            assumed.popitem(last=False)

    def snapshot(self, eid: EndpointId, seq: int, hashes: Iterable[BlockHash]) -> None:
        """Replace the endpoint's exact block set with a snapshot current to `seq`."""
        blocks = self._get(eid)
        blocks.exact = set(hashes)
        blocks.seq = seq

    def event(self, eid: EndpointId, seq: int, stored: bool, hashes: Iterable[BlockHash]) -> bool:
        """Apply one KV event; False when it does not follow the last one (resync needed)."""
        blocks = self._get(eid)
        if blocks.seq is None or seq != blocks.seq + 1:
            blocks.seq = None
            return False
        blocks.seq = seq
        if stored:
            for h in hashes:
                blocks.exact.add(h)
                blocks.assumed.pop(h, None)
        else:
            blocks.exact.difference_update(hashes)
        return True

    def lost(self, eid: EndpointId) -> None:
        """The event stream broke: keep serving the last known set until the next snapshot."""
        blocks = self._by_endpoint.get(eid)
        if blocks is not None:
            blocks.seq = None

    def forget(self, eid: EndpointId) -> None:
        """The endpoint left the registry."""
        self._by_endpoint.pop(eid, None)


RAM, SSD = 1, 2  # tier bits


@dataclass(slots=True)
class _Tiers:
    held: dict[BlockHash, int] = field(default_factory=dict)  # hash -> tier bits
    seq: int | None = None


class TierIndex:
    """Per node, the blocks its cgn-kvcached holds in RAM and on SSD (exact, from events)."""

    def __init__(self) -> None:
        self._by_node: dict[str, _Tiers] = {}

    def extend(self, node: str, hashes: Sequence[BlockHash], start: int) -> tuple[int, int]:
        """Of `hashes[start:]`, the leading run the node holds: (blocks in RAM, on SSD only)."""
        tiers = self._by_node.get(node)
        if tiers is None or start >= len(hashes):
            return 0, 0
        ram = ssd = 0
        for h in hashes[start:]:
            bits = tiers.held.get(h, 0)
            if bits & RAM:
                ram += 1
            elif bits & SSD:
                ssd += 1
            else:
                break
        return ram, ssd

    def size(self, node: str) -> int:
        tiers = self._by_node.get(node)
        return len(tiers.held) if tiers else 0

    def snapshot(
        self, node: str, seq: int, tier: int, hashes: Iterable[BlockHash], first: bool
    ) -> None:
        """A tier's snapshot; `first`: the first of a stream's snapshots (replaces all)."""
        tiers = self._by_node.setdefault(node, _Tiers())
        if first:
            tiers.held = {}
        held = tiers.held
        for h in hashes:
            held[h] = held.get(h, 0) | tier
        tiers.seq = seq

    def event(
        self, node: str, seq: int, stored: bool, tier: int, hashes: Iterable[BlockHash]
    ) -> bool:
        """Apply one event; False when it does not follow the last one (resync needed)."""
        tiers = self._by_node.get(node)
        if tiers is None or tiers.seq is None or seq != tiers.seq + 1:
            if tiers is not None:
                tiers.seq = None
            return False
        tiers.seq = seq
        held = tiers.held
        for h in hashes:
            bits = held.get(h, 0)
            bits = bits | tier if stored else bits & ~tier
            if bits:
                held[h] = bits
            else:
                held.pop(h, None)
        return True

    def forget(self, node: str) -> None:
        """The node's kvcached left etcd (or its stream is gone for good)."""
        self._by_node.pop(node, None)
