"""A fixed pool of KV blocks with a prefix cache keyed by the block-hash contract.

Groundwork for issue #4 (paged KV and prefix reuse); the engine does not use
it yet. Pure bookkeeping, no tensors: a block id indexes the backend's KV
memory.

Algorithm (vLLM/nano-vllm style):
* the pool holds `num_blocks` blocks of BLOCK_SIZE tokens; a block is
  *free* (never filled, or its content dropped), *in use* (ref_count > 0), or
  *cached* (ref_count == 0 but its full-block hash is registered, so a later
  request with the same prefix can take it back);
* `acquire_prefix` walks a prompt's chained block hashes (cgn_core.kv.blockhash)
  and takes every leading block already cached, verifying the token ids, and
  stops at the first miss;
* `admit` does both for a new request, all or nothing;
* `allocate` takes never-used free blocks first, then evicts cached blocks in
  least-recently-released order (each eviction publishes a `removed` event);
* `commit` registers a block that has just become full (a `stored` event;
  `drain_events` merges a run of them, or of evictions, into one event);
* `release` drops references in reverse order, so a sequence's tail is
  evicted before its shared prefix.
Tunables: `num_blocks` and the namespace (the model's). A sequence of a salted tenant
walks and commits under its own namespace (`salted`: the model's plus its salt): its
blocks share the pool, never an identity with another tenant's (#58).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NewType

from cgn_core.kv.blockhash import (
    BLOCK_SIZE,
    ROOT,
    BlockHash,
    block_hash,
    iter_block_hashes,
    salted,
)
from cgn_core.kv.events import KvEvent

BlockId = NewType("BlockId", int)


@dataclass(slots=True)
class Block:
    id: BlockId
    ref_count: int = 0
    hash: BlockHash | None = None
    tokens: tuple[int, ...] = ()


class PoolExhausted(Exception):
    """Not enough free or evictable blocks; the caller preempts or queues."""


@dataclass(slots=True)
class BlockPool:
    num_blocks: int
    namespace: str
    blocks: list[Block] = field(init=False)
    _free: list[BlockId] = field(init=False)  # never filled / dropped; popped from the end
    _cached: OrderedDict[BlockId, None] = field(default_factory=OrderedDict)  # LRU first
    _by_hash: dict[BlockHash, BlockId] = field(default_factory=dict)
    # changes since the last drain, consecutive ones of a kind merged: one event per run
    _pending: list[tuple[Literal["stored", "removed"], list[BlockHash]]] = field(
        default_factory=list
    )
    _seq: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.blocks = [Block(BlockId(i)) for i in range(self.num_blocks)]
        self._free = [BlockId(i) for i in reversed(range(self.num_blocks))]

    @property
    def available(self) -> int:
        """Blocks an `allocate` could hand out now (free plus evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.available / self.num_blocks

    def cached_hashes(self) -> list[BlockHash]:
        """Every registered block hash (the snapshot a KV-event subscriber starts from)."""
        return list(self._by_hash)

    def cached_prefix_hint(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` the pool holds now. Safe to call from another thread,
        but only a hint there: the engine thread may change the pool right after."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def salted(self, salt: str | None) -> str:
        """The namespace a sequence of `salt` hashes its blocks in (the pool's for None)."""
        return salted(self.namespace, salt)

    def acquire_prefix(self, tokens: Sequence[int], ns: str | None = None) -> list[BlockId]:
        """Take references on the longest run of leading full blocks already in the pool
        (hashed in `ns`, a `salted` namespace; the pool's own by default)."""
        taken: list[BlockId] = []
        for i, h in enumerate(iter_block_hashes(tokens, ns or self.namespace)):
            bid = self._by_hash.get(h)
            block = self.blocks[bid] if bid is not None else None
            if block is None or block.tokens != tuple(
                tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            ):
                break  # NOTE: a hash hit is trusted only when the token ids match too
            if block.ref_count == 0:
                del self._cached[block.id]
            block.ref_count += 1
            taken.append(block.id)
        return taken

    def hashes_of(self, ids: Sequence[BlockId]) -> list[BlockHash]:
        """The registered hashes of blocks `ids` (a prefix `acquire_prefix` just took: its
        walk named them, so a sequence never hashes its reused prompt again)."""
        out = []
        for bid in ids:
            h = self.blocks[bid].hash
            assert h is not None, f"block {bid} holds no registered prefix"
            out.append(h)
        return out

    def admit(
        self, tokens: Sequence[int], extra_tokens: int = 0, ns: str | None = None
    ) -> tuple[list[BlockId], int]:
        """A block table for `tokens` plus room for `extra_tokens`: the cached prefix reused,
        the rest allocated. Returns (table, number of reused blocks). All or nothing: on
        PoolExhausted no reference is left behind."""
        table = self.acquire_prefix(tokens, ns)
        reused = len(table)
        needed = -(-(len(tokens) + extra_tokens) // BLOCK_SIZE) - reused
        try:
            table += self.allocate(needed)
        except PoolExhausted:
            self.release(table)
            raise
        return table, reused

    def allocate(self, n: int) -> list[BlockId]:
        """`n` blocks with one reference each; evicts least recently released cached blocks."""
        if n > self.available:
            raise PoolExhausted(f"need {n} blocks, {self.available} available")
        out: list[BlockId] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            if self._free:
                bid = self._free.pop()
            else:
                bid, _ = self._cached.popitem(last=False)
                block = self.blocks[bid]
                assert block.hash is not None
                del self._by_hash[block.hash]
                evicted.append(block.hash)
                block.hash, block.tokens = None, ()
            self.blocks[bid].ref_count = 1
            out.append(bid)
        if evicted:
            self._publish("removed", evicted)
        return out

    def commit(
        self, bid: BlockId, parent: BlockHash | None, tokens: Sequence[int], ns: str | None = None
    ) -> BlockHash:
        """Register block `bid`, now full with `tokens` after `parent` (None: the first block),
        hashed in `ns` (the pool's namespace by default)."""
        h = block_hash(parent or ROOT, tokens, ns or self.namespace)
        block = self.blocks[bid]
        if block.hash is None and h not in self._by_hash:
            block.hash, block.tokens = h, tuple(tokens)
            self._by_hash[h] = bid
            self._publish("stored", [h])
        return h

    def release(self, bids: Sequence[BlockId]) -> None:
        """Drop one reference on each of `bids` (a finished or preempted sequence's table)."""
        for bid in reversed(bids):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise ValueError(f"block {bid} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._cached[bid] = None
                else:
                    self._free.append(bid)

    def drain_events(self) -> list[KvEvent]:
        """The changes since the last drain, in order: one event per run of stored or removed
        blocks (a step that fills 30 blocks publishes one event, not 30), numbered from 1."""
        events = []
        for kind, hashes in self._pending:
            self._seq += 1
            events.append(KvEvent(self._seq, kind, tuple(hashes)))
        self._pending = []
        return events

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every step)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        for b in self.blocks:
            if b.ref_count > 0:
                assert b.id not in free and b.id not in cached
            else:
                assert (b.id in cached) == (b.hash is not None) and (b.id in free) != (
                    b.id in cached
                )
            if b.hash is not None:
                assert self._by_hash[b.hash] == b.id
        assert len(self._by_hash) == sum(b.hash is not None for b in self.blocks)

    def _publish(self, kind: Literal["stored", "removed"], hashes: list[BlockHash]) -> None:
        if self._pending and self._pending[-1][0] == kind:
            self._pending[-1][1].extend(hashes)
        else:
            self._pending.append((kind, list(hashes)))
