"""Where KV blocks live: one index over every endpoint, exact from KV events or assumed.

Exact: an engine that streams KV events (cgn-infer) sends a snapshot and then
STORED/REMOVED events numbered seq+1, seq+2, ...; the index mirrors its block
set and reports a gap (a missed event) so the subscriber resyncs from a fresh
snapshot.

Assumed: for engines without events, the blocks of each request routed to an
endpoint are assumed cached there for `approx_ttl_s`, at most `approx_blocks`
per endpoint, least recently used evicted first. Event-fed endpoints get the
same treatment for `optimistic_ttl_s`, bridging the time between routing a
request and its STORED event.

One index for the whole fleet (issue #27): block key → the endpoints holding
it, each endpoint a small slot number and a set of holders one int used as a
bit mask. Because a block's hash covers every token before it, the endpoints
holding block i of a prompt and all blocks before it are the intersection of
the holders of blocks 0..i, so `match_all` walks the prompt once and reads
every endpoint's longest cached prefix off the point where its bit drops out:
O(prompt blocks), whatever the number of endpoints.

Keys are the hashes' first 8 bytes as an int (half the memory of the 32-byte
hash). Two blocks share a key with probability ~n²/2⁶⁵ (1e-5 for 16M blocks);
a collision can only make the router believe an endpoint holds a block it
does not (a worse pick, one prefill), never make an engine use the wrong KV:
engines and stores key their blocks by the full hash. Memory per (endpoint,
block): 8 bytes in the endpoint's key list, plus, per distinct block, one
dict entry, its key and its holder mask (docs/cgn-router.md, "Fleet scale").

`match(eid, ...)`: one endpoint's longest run of leading prompt blocks.

Bounded memory: the exact sets are what engines and stores say they hold, and
an engine may say a great deal (a bug, a flood, a fleet larger than planned),
so each index has a byte budget (`routing.index_budget_mb`: three quarters for
the engines' blocks, a quarter for the stores' tiers). Past it, the source
holding the most loses its oldest-stored quarter: the router forgets blocks an
engine may still hold (a worse pick, one prefill), never believes one it does
not. The bytes per block are measured (KEY_BYTES below); the flood test in
tests/test_kv_index.py and bench/router_index_budget.py check them.

Node tiers (`TierIndex`): each node's cgn-kvcached streams what its RAM and
SSD tiers hold (one snapshot per tier, then events carrying their tier), so
`extend()` says how many more of a prompt's blocks, past what an engine's own
pool holds, that engine's node could restore, and from which tier.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cgn_core.kv.blockhash import BlockHash
from cgn_router.types import EndpointId

# What a block costs in the process's RSS once the index has churned (dicts at their peak
# size, freed ints kept in Python's pools): 1.4x what tracemalloc measures for one fill
# (a distinct key 72-90 B, each holder 8 B, a store's block ~118 B), from
# bench/router_index_budget.py, whose RSS at a budget of 256 and 512 MiB was 1.3x the
# share the index had counted at 1.0x.
KEY_BYTES = 140  # a distinct block: its dict entry, int key and holders
HOLDER_BYTES = 14  # each endpoint's 8-byte key in its list, with the list's spare room
TIER_BYTES = 180  # a store's block: dict entry, 32-byte hash, tier bits
CHECK_EVERY = 4096  # stored keys between two looks at the budget
HIGH, LOW = 0.9, 0.75  # past HIGH of the budget, the oldest are forgotten down to LOW
UNLIMITED = 1 << 62


def key(h: bytes) -> int:
    """The index key of a block hash: its first 8 bytes."""
    return int.from_bytes(h[:8], "little")


class KeyedBlocks(tuple[BlockHash, ...]):
    """A prompt's block hashes with their index keys, computed once where they were hashed
    (the prompt prefix cache keeps both): the index does not key them again."""

    index_keys: list[int]

    @classmethod
    def of(cls, hashes: Sequence[BlockHash], keys: list[int]) -> KeyedBlocks:
        out = cls(hashes)
        out.index_keys = keys
        return out


@dataclass(slots=True)
class _Slot:
    eid: EndpointId
    n: int  # the slot number
    bit: int  # 1 << n
    keys: array[int] = field(default_factory=lambda: array("Q"))  # exact keys set (some stale)
    exact: int = 0  # how many keys hold this endpoint's bit now
    seq: int | None = None  # None: no snapshot yet (or lost); exact set not trusted
    assumed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> expiry
    ttl: float = 0.0  # of its assumed blocks: one per endpoint, so they expire in order


class PrefixIndex:
    def __init__(
        self,
        approx_ttl_s: float,
        approx_blocks: int,
        optimistic_ttl_s: float,
        budget_bytes: int = UNLIMITED,
    ):
        self.budget_bytes = budget_bytes
        self.forgotten = 0  # blocks dropped to stay within the budget
        self._unchecked = 0  # keys stored since the budget was last looked at
        self.approx_ttl_s = approx_ttl_s
        self.approx_blocks = approx_blocks
        self.optimistic_ttl_s = optimistic_ttl_s
        self._slots: dict[EndpointId, _Slot] = {}
        self._by_bit: dict[int, _Slot] = {}
        self._free: list[int] = []  # slot numbers to reuse
        self._next = 0
        # key -> its holders (events): a bit mask, or, for the common single holder, that
        # slot's shared negative tag (-1 - slot): no int object per block for the mask
        self._exact: dict[int, int] = {}
        self._tags: list[int] = []  # slot -> its tag, one int object shared by every entry
        self._assumed: dict[int, int] = {}  # key -> mask of those assumed to hold it
        self._expiry: list[tuple[float, int, EndpointId]] = []  # (front expiry, bit, endpoint)
        self._memo: tuple[Sequence[BlockHash], list[int]] = ((), [])  # the last prompt's keys

    def _keys(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The keys of `hashes`, computed once for a prompt looked up then routed (the same
        tuple: a request's blocks; anything mutable is keyed afresh)."""
        if hashes is self._memo[0]:
            return self._memo[1]
        keys = hashes.index_keys if isinstance(hashes, KeyedBlocks) else [key(h) for h in hashes]
        if isinstance(hashes, tuple):
            self._memo = (hashes, keys)
        return keys

    # ---- reading ---------------------------------------------------------------------------

    def match_all(
        self, hashes: Sequence[BlockHash], now: float, among: int = -1, top: int | None = None
    ) -> dict[EndpointId, int]:
        """Every endpoint (within the `among` mask) holding the prompt's first blocks, and
        how many it holds in a row; with `top`, only the `top` holding the most. Endpoints
        holding none are left out."""
        self._expire(now)
        exact, assumed = self._exact, self._assumed
        alive, ended = among, {}  # `among` may be -1 (every bit) until the first block
        for i, k in enumerate(self._keys(hashes)):
            v = exact.get(k, 0)
            held = alive & ((v if v >= 0 else 1 << (-1 - v)) | assumed.get(k, 0))
            if held != alive:
                gone = alive & ~held
                if i:
                    ended[gone] = i
                alive = held
                if not alive:
                    break
        else:
            if hashes and alive:
                ended[alive] = len(hashes)
        out: dict[EndpointId, int] = {}
        by_bit = self._by_bit
        for mask, n in reversed(ended.items()):  # the longest runs first
            for b in _bits(mask):
                if top is not None and len(out) >= top:
                    return out
                if b in by_bit:
                    out[by_bit[b].eid] = n
        return out

    def match(self, eid: EndpointId, hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading `hashes` the endpoint holds."""
        slot = self._slots.get(eid)
        return 0 if slot is None else self.match_all(hashes, now, slot.bit).get(eid, 0)

    def mask(self, eids: Iterable[EndpointId]) -> int:
        """The bit mask of the endpoints among `eids` the index knows."""
        out = 0
        for eid in eids:
            slot = self._slots.get(eid)
            if slot is not None:
                out |= slot.bit
        return out

    def exact_size(self, eid: EndpointId) -> int:
        slot = self._slots.get(eid)
        return slot.exact if slot else 0

    def assumed_size(self, eid: EndpointId) -> int:
        slot = self._slots.get(eid)
        return len(slot.assumed) if slot else 0

    # ---- assumed blocks --------------------------------------------------------------------

    def routed(
        self, eid: EndpointId, hashes: Sequence[BlockHash], now: float, *, exact: bool
    ) -> None:
        """A request with `hashes` was sent to `eid`: assume its blocks cached there."""
        slot = self._get(eid)
        ttl = self.optimistic_ttl_s if exact else self.approx_ttl_s
        if ttl != slot.ttl:  # NOTE: it started or stopped publishing events: start afresh
            for k in slot.assumed:
                self._unassume(slot, k)
            slot.assumed.clear()
            slot.ttl = ttl
        expiry = now + ttl
        bit, held, assumed, mine = slot.bit, self._exact, self._assumed, slot.assumed
        was_empty, tag = not mine, self._tags[slot.n]
        for k in self._keys(hashes):
            v = held.get(k, 0)
            if v == tag or (v > 0 and v & bit):  # held exactly: nothing to assume
                continue
            if k in mine:
                mine.move_to_end(k)
            else:
                assumed[k] = assumed.get(k, 0) | bit
            mine[k] = expiry
        while len(mine) > self.approx_blocks:
            self._unassume(slot, mine.popitem(last=False)[0])
        if was_empty and mine:
            heapq.heappush(self._expiry, (next(iter(mine.values())), bit, eid))

    def _expire(self, now: float) -> None:
        """Drop assumed blocks whose time is up (each endpoint's list is in expiry order)."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, bit, eid = heapq.heappop(heap)
            slot = self._slots.get(eid)
            if slot is None or slot.bit != bit:
                continue  # forgotten since
            mine = slot.assumed
            while mine:
                k, expiry = next(iter(mine.items()))
                if expiry > now:
                    heapq.heappush(heap, (expiry, bit, eid))
                    break
                del mine[k]
                self._unassume(slot, k)

    def _unassume(self, slot: _Slot, k: int) -> None:
        left = self._assumed.get(k, 0) & ~slot.bit
        if left:
            self._assumed[k] = left
        else:
            self._assumed.pop(k, None)

    # ---- exact blocks, from KV events ------------------------------------------------------

    def snapshot(self, eid: EndpointId, seq: int, hashes: Iterable[BlockHash]) -> None:
        """Replace the endpoint's exact block set with a snapshot current to `seq`."""
        slot = self._get(eid)
        self._clear_exact(slot)
        self._store(slot, hashes)
        slot.seq = seq

    def event(self, eid: EndpointId, seq: int, stored: bool, hashes: Iterable[BlockHash]) -> bool:
        """Apply one KV event; False when it does not follow the last one (resync needed)."""
        slot = self._get(eid)
        if slot.seq is None or seq != slot.seq + 1:
            slot.seq = None
            return False
        slot.seq = seq
        if stored:
            self._store(slot, hashes)
            return True
        for h in hashes:
            if self._drop(key(h), slot):
                slot.exact -= 1
        if len(slot.keys) > 2 * slot.exact + 1024:  # mostly stale: keep the live ones only
            held = self._exact
            slot.keys = array("Q", (k for k in slot.keys if self._holds(held.get(k, 0), slot)))
        return True

    def _store(self, slot: _Slot, hashes: Iterable[BlockHash]) -> None:
        held, mine, tag = self._exact, slot.assumed, self._tags[slot.n]
        for h in hashes:
            k = key(h)
            v = held.get(k, 0)
            if not self._holds(v, slot):
                held[k] = tag if v == 0 else (v if v > 0 else 1 << (-1 - v)) | slot.bit
                slot.exact += 1
                slot.keys.append(k)
                self._unchecked += 1
            if k in mine:  # confirmed: no longer only assumed
                del mine[k]
                self._unassume(slot, k)
        if self._unchecked >= CHECK_EVERY:
            self._unchecked = 0
            self._keep_to_budget()

    def bytes_used(self) -> int:
        """The exact sets' memory, by the measured costs above."""
        holders = sum(len(s.keys) for s in self._slots.values())
        return len(self._exact) * KEY_BYTES + holders * HOLDER_BYTES

    def _keep_to_budget(self) -> None:
        """Near the budget: the endpoint holding the most forgets its oldest-stored quarter,
        until the index is at 3/4 of it (so this does not run on every event)."""
        if self.bytes_used() <= self.budget_bytes * HIGH:
            return
        while self._slots and self.bytes_used() > self.budget_bytes * LOW:
            slot = max(self._slots.values(), key=lambda s: len(s.keys))
            if not slot.keys:
                return
            cut = max(1, len(slot.keys) // 4)
            for k in slot.keys[:cut]:
                if self._drop(k, slot):
                    slot.exact -= 1
                    self.forgotten += 1
            slot.keys = slot.keys[cut:]

    def _clear_exact(self, slot: _Slot) -> None:
        for k in slot.keys:
            self._drop(k, slot)
        slot.keys, slot.exact = array("Q"), 0

    @staticmethod
    def _holds(v: int, slot: _Slot) -> bool:
        """Whether holders `v` (a mask or a tag) include `slot`."""
        return bool(v & slot.bit) if v >= 0 else -1 - v == slot.n

    def _drop(self, k: int, slot: _Slot) -> bool:
        """Take `slot` off key `k`'s holders; False when it was not one."""
        held = self._exact
        v = held.get(k, 0)
        if not self._holds(v, slot):
            return False
        left = 0 if v < 0 else v & ~slot.bit
        if not left:
            del held[k]
        elif left & (left - 1):  # still several
            held[k] = left
        else:  # one left: back to its tag
            held[k] = self._tags[left.bit_length() - 1]
        return True

    def lost(self, eid: EndpointId) -> None:
        """The event stream broke: keep serving the last known set until the next snapshot."""
        slot = self._slots.get(eid)
        if slot is not None:
            slot.seq = None

    def forget(self, eid: EndpointId) -> None:
        """The endpoint left the registry: its bit is cleared everywhere and reused."""
        slot = self._slots.pop(eid, None)
        if slot is None:
            return
        self._clear_exact(slot)
        for k in slot.assumed:
            self._unassume(slot, k)
        del self._by_bit[slot.bit]
        self._free.append(slot.n)

    # ---- slots -----------------------------------------------------------------------------

    def _get(self, eid: EndpointId) -> _Slot:
        slot = self._slots.get(eid)
        if slot is None:
            n = self._free.pop() if self._free else self._take()
            slot = self._slots[eid] = self._by_bit[1 << n] = _Slot(eid, n, 1 << n)
        return slot

    def _take(self) -> int:
        n, self._next = self._next, self._next + 1
        self._tags.append(-1 - n)
        return n


def _bits(mask: int) -> Iterable[int]:
    """Each set bit of a (non-negative) mask, as its own int."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


RAM, SSD = 1, 2  # tier bits


@dataclass(slots=True)
class _Tiers:
    held: dict[BlockHash, int] = field(default_factory=dict)  # hash -> tier bits
    seq: int | None = None


class TierIndex:
    """Per node, the blocks its cgn-kvcached holds in RAM and on SSD (exact, from events)."""

    def __init__(self, budget_bytes: int = UNLIMITED) -> None:
        self._by_node: dict[str, _Tiers] = {}
        self.budget_bytes = budget_bytes
        self.forgotten = 0
        self._unchecked = 0

    def _keep_to_budget(self) -> None:
        """As PrefixIndex's: the node holding the most forgets its oldest-stored quarter."""
        limit = HIGH
        while self._by_node:
            total = sum(len(t.held) for t in self._by_node.values())
            if total * TIER_BYTES <= self.budget_bytes * limit:
                return
            limit = LOW
            tiers = max(self._by_node.values(), key=lambda t: len(t.held))
            cut = max(1, len(tiers.held) // 4)
            # NOTE: a new dict, not deletions from the front (each would scan the holes)
            tiers.held = dict(itertools.islice(tiers.held.items(), cut, None))
            self.forgotten += cut

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
        self._keep_to_budget()

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
                self._unchecked += 1
            else:
                held.pop(h, None)
        if self._unchecked >= CHECK_EVERY:
            self._unchecked = 0
            self._keep_to_budget()
        return True

    def forget(self, node: str) -> None:
        """The node's kvcached left etcd (or its stream is gone for good)."""
        self._by_node.pop(node, None)
