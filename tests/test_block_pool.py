"""The KV block pool: exact block ids, reference counts, eviction order, events, invariants."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cgn_core.kv.blockhash import BLOCK_SIZE, block_hashes
from cgn_infer.block_pool import BlockId, BlockPool, PoolExhausted

NS = "m"


def fill(pool: BlockPool, tokens: list[int]) -> list[BlockId]:
    """What an engine does for a new prompt: reuse the cached prefix, allocate and commit the rest."""
    table, _ = pool.admit(tokens)
    hashes = block_hashes(tokens, NS)
    parent = None
    for i, h in enumerate(hashes):
        assert pool.commit(table[i], parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]) == h
        parent = h
    return table


def toks(start: int, n_blocks: int, tail: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK_SIZE + tail))


def test_allocation_order_and_prefix_reuse() -> None:
    pool = BlockPool(6, NS)
    a = fill(pool, toks(0, 2, tail=5))
    assert a == [0, 1, 2] and pool.available == 3
    events = pool.drain_events()  # the two blocks filled since the last drain: one event
    assert [(e.kind, e.seq) for e in events] == [("stored", 1)]
    assert list(events[0].hashes) == block_hashes(toks(0, 2), NS)
    # Same two leading blocks, different tail: blocks 0 and 1 are shared.
    b = fill(pool, toks(0, 2) + [999] * 16)
    assert b[:2] == [0, 1] and b[2] == 3
    assert [pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert pool.usage == pytest.approx(4 / 6)


def test_eviction_is_lru_and_tail_first() -> None:
    pool = BlockPool(4, NS)
    a = fill(pool, toks(0, 2))  # blocks 0, 1
    b = fill(pool, toks(100, 2))  # blocks 2, 3
    pool.release(a)  # tail first: LRU order 1, 0
    pool.release(b)  # then 3, 2
    pool.drain_events()
    got = pool.allocate(3)
    assert got == [1, 0, 3]
    removed = [h for e in pool.drain_events() for h in e.hashes]
    assert removed == [
        block_hashes(toks(0, 2), NS)[1],
        block_hashes(toks(0, 2), NS)[0],
        block_hashes(toks(100, 2), NS)[1],
    ]
    # Block 2 (b's first block) survived and still serves that prefix.
    assert pool.acquire_prefix(toks(100, 2)) == [2]


def test_a_referenced_block_is_never_evicted_and_exhaustion_is_clear() -> None:
    pool = BlockPool(3, NS)
    table = fill(pool, toks(0, 2))
    with pytest.raises(PoolExhausted, match="need 2 blocks, 1 available"):
        pool.allocate(2)
    # admit is all or nothing: the prefix it reused is given back on failure.
    with pytest.raises(PoolExhausted):
        pool.admit(toks(0, 2), extra_tokens=3 * BLOCK_SIZE)
    assert [pool.blocks[b].ref_count for b in table] == [1, 1]
    pool.check()


def test_hash_hit_with_different_tokens_is_not_reused() -> None:
    pool = BlockPool(4, NS)
    (bid,) = fill(pool, toks(0, 1))
    pool.release([bid])
    pool.blocks[bid].tokens = tuple(range(50, 66))  # as if the hash collided
    assert pool.acquire_prefix(toks(0, 1)) == []


def test_a_salted_sequence_reuses_only_its_own_namespaces_blocks() -> None:
    """Tenants share the pool's blocks, never a block's identity (#58): the same prompt under
    another salt (or none) is a miss, under the same salt a hit; events carry salted hashes."""
    pool = BlockPool(16, NS)
    prompt = toks(0, 3)
    a_ns = pool.salted("tenant-a")
    table, reused = pool.admit(prompt, 0, a_ns)
    assert reused == 0
    parent = None
    for i in range(3):
        parent = pool.commit(table[i], parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], a_ns)
    assert parent == block_hashes(prompt, f"{NS}|tenant-a")[-1]
    pool.release(table)
    assert pool.acquire_prefix(prompt) == []  # unsalted: nothing
    assert pool.acquire_prefix(prompt, pool.salted("tenant-b")) == []
    again = pool.acquire_prefix(prompt, a_ns)
    assert again == table
    stored = [h for ev in pool.drain_events() if ev.kind == "stored" for h in ev.hashes]
    assert stored == block_hashes(prompt, a_ns) and pool.salted(None) == NS


def test_release_more_than_acquired_is_refused() -> None:
    pool = BlockPool(2, NS)
    (bid,) = pool.allocate(1)
    pool.release([bid])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([bid])


class PoolMachine(RuleBasedStateMachine):
    """Random sequences come and go; the pool's accounting must always balance."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, NS)
        self.live: list[list[BlockId]] = []

    @rule(prefix=st.integers(0, 2), blocks=st.integers(1, 4), tail=st.integers(0, 15))
    def admit(self, prefix: int, blocks: int, tail: int) -> None:
        tokens = toks(prefix * 1000, blocks, tail)
        # On PoolExhausted the invariant below checks that admit gave back what it took.
        with contextlib.suppress(PoolExhausted):
            self.live.append(fill(self.pool, tokens))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        self.pool.release(self.live.pop(index % len(self.live)))

    @invariant()
    def balanced(self) -> None:
        self.pool.check()
        owned = [b for table in self.live for b in table]
        for block in self.pool.blocks:
            assert block.ref_count == owned.count(block.id)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_events_merge_runs_of_one_kind_and_keep_their_order() -> None:
    """Runs of stored or removed blocks between two drains are one event each, numbered in
    order, and replaying the events gives the pool's cached set."""
    pool = BlockPool(4, NS)
    pool.release(fill(pool, toks(0, 2)))
    pool.release(fill(pool, toks(100, 2)))
    first = pool.drain_events()
    assert [(e.kind, e.seq, len(e.hashes)) for e in first] == [("stored", 1, 4)]
    pool.release(fill(pool, toks(200, 2)))  # evicts two blocks, stores two
    fill(pool, toks(300, 1))  # evicts one, stores one
    events = pool.drain_events()
    assert [(e.kind, e.seq, len(e.hashes)) for e in events] == [
        ("removed", 2, 2), ("stored", 3, 2), ("removed", 4, 1), ("stored", 5, 1)]  # fmt: skip
    held: set[bytes] = set()
    for e in first + events:
        held = held | set(e.hashes) if e.kind == "stored" else held - set(e.hashes)
    assert held == {b.hash for b in pool.blocks if b.hash is not None}
    assert pool.drain_events() == []
