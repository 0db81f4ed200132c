"""The router's KV index: exact sets from KV events, node tiers, assumed blocks, its memory
budget, and the pool/tier event streams that feed it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_proto.cognitora.v1 import kv_events_pb2 as ev
from cgn_router.kv_follow import StreamRefused, apply_pool, apply_tiers
from cgn_router.routing.kv_index import RAM, SSD, PrefixIndex, TierIndex
from cgn_router.types import EndpointId

E = EndpointId("m/r1")
H = [bytes([i]) * 32 for i in range(6)]


def test_exact_tracking_follows_events_and_detects_a_gap() -> None:
    idx = PrefixIndex(approx_ttl_s=60, approx_blocks=100, optimistic_ttl_s=1)
    idx.snapshot(E, 10, H[:3])
    assert idx.match(E, H, now=0) == 3
    assert idx.event(E, 11, True, H[3:5])
    assert idx.match(E, H, now=0) == 5
    assert idx.event(E, 12, False, [H[1]])
    assert idx.match(E, H, now=0) == 1  # the run stops at the removed block
    assert not idx.event(E, 14, True, [H[1]])  # seq 13 was missed
    assert not idx.event(E, 15, True, [H[1]])  # no trust until a new snapshot
    assert idx.match(E, H, now=0) == 1  # the last known set still serves
    idx.snapshot(E, 20, H)
    assert idx.match(E, H, now=0) == 6 and idx.event(E, 21, False, [H[0]])
    assert idx.match(E, H, now=0) == 0


class PerEndpointIndex:
    """The brute-force model of `PrefixIndex`: one block set per endpoint, each walked alone
    (what the router did before the one global index)."""

    def __init__(self, approx_ttl_s: float, approx_blocks: int, optimistic_ttl_s: float):
        self.ttl = {False: approx_ttl_s, True: optimistic_ttl_s}
        self.cap = approx_blocks
        self.exact: dict[str, set[bytes]] = {}
        self.seq: dict[str, int | None] = {}
        self.assumed: dict[str, OrderedDict[bytes, float]] = {}
        self.mode: dict[str, bool] = {}  # whether its blocks were last routed as exact

    def match(self, eid: str, hashes: list[bytes], now: float) -> int:
        exact, assumed, n = self.exact.get(eid, set()), self.assumed.get(eid, {}), 0
        for h in hashes:
            if h not in exact and assumed.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def routed(self, eid: str, hashes: list[bytes], now: float, exact: bool) -> None:
        if self.mode.get(eid, exact) != exact:  # it started or stopped publishing events
            self.assumed.pop(eid, None)
        self.mode[eid] = exact
        mine = self.assumed.setdefault(eid, OrderedDict())
        for h in hashes:
            if h not in self.exact.get(eid, set()):
                mine[h] = now + self.ttl[exact]
                mine.move_to_end(h)
        while len(mine) > self.cap:
            mine.popitem(last=False)

    def stored(self, eid: str, hashes: list[bytes]) -> None:
        self.exact.setdefault(eid, set()).update(hashes)
        for h in hashes:
            self.assumed.get(eid, {}).pop(h, None)

    def snapshot(self, eid: str, seq: int, hashes: list[bytes]) -> None:
        self.exact[eid] = set()
        self.stored(eid, hashes)
        self.seq[eid] = seq

    def event(self, eid: str, seq: int, stored: bool, hashes: list[bytes]) -> bool:
        last = self.seq.get(eid)
        if last is None or seq != last + 1:
            self.seq[eid] = None
            return False
        self.seq[eid] = seq
        if stored:
            self.stored(eid, hashes)
        else:
            self.exact.get(eid, set()).difference_update(hashes)
        return True

    def forget(self, eid: str) -> None:
        for table in (self.exact, self.seq, self.assumed, self.mode):
            table.pop(eid, None)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_global_index_matches_a_walk_per_endpoint(data: st.DataObject) -> None:
    """Random event streams (snapshots, stored, removed, gaps, routed blocks expiring or
    evicted, endpoints leaving): every endpoint's match equals the brute-force model's."""
    blocks = [bytes([i]) * 32 for i in range(12)]
    eids = [EndpointId(f"m/e{i}") for i in range(5)]
    idx, model = PrefixIndex(3.0, 6, 1.0), PerEndpointIndex(3.0, 6, 1.0)
    now, seqs = 0.0, dict.fromkeys(eids, 0)
    some = st.lists(st.sampled_from(blocks), max_size=8)
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(
            st.sampled_from(["snapshot", "stored", "removed", "gap", "routed", "tick", "forget"])
        )
        eid = data.draw(st.sampled_from(eids))
        if op == "snapshot":
            hashes, seqs[eid] = data.draw(some), seqs[eid] + 5
            idx.snapshot(eid, seqs[eid], hashes)
            model.snapshot(eid, seqs[eid], hashes)
        elif op in ("stored", "removed", "gap"):
            seqs[eid] += 2 if op == "gap" else 1
            hashes = data.draw(some)
            stored = op != "removed"
            assert idx.event(eid, seqs[eid], stored, hashes) == model.event(
                eid, seqs[eid], stored, hashes
            )
        elif op == "routed":
            hashes, exact = data.draw(some), data.draw(st.booleans())
            idx.routed(eid, hashes, now, exact=exact)
            model.routed(eid, hashes, now, exact)
        elif op == "tick":
            now += data.draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
        else:
            idx.forget(eid)
            model.forget(eid)
        prompt = data.draw(st.lists(st.sampled_from(blocks), max_size=10) | st.just(blocks))
        want = {e: model.match(e, prompt, now) for e in eids}
        assert idx.match_all(prompt, now) == {e: n for e, n in want.items() if n}
        assert {e: idx.match(e, prompt, now) for e in eids} == want
        best = idx.match_all(prompt, now, top=2)  # the two longest runs (ties: either)
        assert all(want[e] == n for e, n in best.items())
        longest = sorted((n for n in want.values() if n), reverse=True)[:2]
        assert sorted(best.values(), reverse=True) == longest
        among = idx.mask(eids[:2])
        assert idx.match_all(prompt, now, among) == {
            e: n for e, n in want.items() if n and e in eids[:2]
        }


@pytest.mark.parametrize(
    ("snapshot", "refused"),
    [
        ({"block_size": 16, "namespace": "m"}, ""),
        ({"block_size": 32, "namespace": "m"}, "blocks of 32 tokens, the router hashes 16"),
        (
            {"block_size": 16, "namespace": "other"},
            "hash namespace 'other', the router expects 'm'",
        ),
        ({"block_size": 16}, "hash namespace '', the router expects 'm'"),
    ],
)
def test_a_pool_stream_must_match_the_hash_contract(snapshot: dict[str, Any], refused: str) -> None:
    idx = PrefixIndex(60, 100, 1)
    msg = ev.KvEventEnvelope(snapshot=ev.KvSnapshot(seq=3, block_hashes=H[:2], **snapshot))
    if not refused:
        assert apply_pool(idx, E, "m", msg) and idx.match(E, H, 0) == 2
        return
    with pytest.raises(StreamRefused, match=refused):
        apply_pool(idx, E, "m", msg)
    assert idx.match(E, H, 0) == 0  # nothing of it was applied
    store = ev.KvEventEnvelope(snapshot=ev.KvSnapshot(seq=1, block_size=16, namespace="m"))
    with pytest.raises(StreamRefused):  # a store holds several models: its namespace is ""
        apply_tiers(TierIndex(), "n1", store, True)


def test_node_tiers_extend_the_pool_match_and_follow_events() -> None:
    tiers = TierIndex()
    h = [bytes([i]) * 32 for i in range(6)]
    tiers.snapshot("n1", 7, RAM, h[:3], first=True)
    tiers.snapshot("n1", 7, SSD, h[2:5], first=False)  # h[2] in both: counted as RAM
    assert tiers.extend("n1", h, 0) == (3, 2)
    assert tiers.extend("n1", h, 1) == (2, 2)  # the pool holds h[0]: only what follows
    assert tiers.extend("n1", h, 5) == (0, 0) and tiers.extend("n2", h, 0) == (0, 0)
    assert tiers.event("n1", 8, False, RAM, [h[1]])  # h[1] left RAM: the run stops there
    assert tiers.extend("n1", h, 0) == (1, 0)
    assert tiers.event("n1", 9, True, SSD, [h[1]])  # ... and went to SSD
    assert tiers.extend("n1", h, 0) == (2, 3)
    assert not tiers.event("n1", 11, True, RAM, [h[5]])  # a gap: resync
    assert not tiers.event("n1", 12, True, RAM, [h[5]])  # until a snapshot
    tiers.snapshot("n1", 20, RAM, [h[0]], first=True)  # the first snapshot replaces all
    assert tiers.extend("n1", h, 0) == (1, 0) and tiers.event("n1", 21, True, RAM, [h[1]])


def test_a_flood_of_blocks_stays_within_the_index_budget() -> None:
    """An engine streaming 300k distinct blocks (and a store 120k) cannot grow the router
    past its index budget, measured by tracemalloc, not by the index's own estimate; the
    flooder forgets its oldest blocks, its newest and a quiet endpoint's are still matched."""
    import tracemalloc

    def blocks(start: int, n: int) -> list[bytes]:
        return [i.to_bytes(32, "little") for i in range(start, start + n)]

    budget = 8 << 20
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        idx = PrefixIndex(60, 100, 1, budget_bytes=budget)
        quiet = blocks(10**9, 50)
        idx.snapshot("quiet", 0, quiet)
        idx.snapshot("flood", 0, [])
        for seq in range(1, 301):
            assert idx.event("flood", seq, True, blocks(seq * 1000, 1000))
        used = tracemalloc.get_traced_memory()[0] - base
        tiers = TierIndex(budget_bytes=budget // 2)
        before = tracemalloc.get_traced_memory()[0]
        tiers.snapshot("n1", 0, RAM, blocks(0, 1), first=True)
        for seq in range(1, 121):
            assert tiers.event("n1", seq, True, SSD, blocks(seq * 1000, 1000))
        tier_used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used <= budget and idx.forgotten > 0, (used, idx.forgotten)
    assert tier_used <= budget // 2 and tiers.forgotten > 0, (tier_used, tiers.forgotten)
    assert idx.match("quiet", quiet, now=0) == 50
    assert idx.match("flood", blocks(300_000, 1000), now=0) == 1000  # the newest
    assert idx.match("flood", blocks(1000, 10), now=0) == 0  # the oldest: forgotten
    assert tiers.extend("n1", blocks(120_000, 1000), 0) == (0, 1000)


def test_approximate_tracking_expires_and_evicts_least_recent() -> None:
    idx = PrefixIndex(approx_ttl_s=10, approx_blocks=4, optimistic_ttl_s=1)
    idx.routed(E, H[:3], now=0, exact=False)
    assert idx.match(E, H, now=9.9) == 3
    assert idx.match(E, H, now=10.0) == 0  # expired
    idx.routed(E, H[:3], now=20, exact=False)
    idx.routed(E, H[3:5], now=21, exact=False)  # 5 blocks > capacity 4: H[0] goes
    assert idx.assumed_size(E) == 4
    assert idx.match(E, H, now=21) == 0
    assert idx.match(E, H[1:], now=21) == 4


def test_optimistic_blocks_bridge_until_the_stored_event() -> None:
    idx = PrefixIndex(approx_ttl_s=60, approx_blocks=100, optimistic_ttl_s=2)
    idx.snapshot(E, 0, [])
    idx.routed(E, H[:2], now=0, exact=True)
    assert idx.match(E, H, now=1) == 2
    assert idx.match(E, H, now=2) == 0  # short TTL: only a bridge
    idx.event(E, 1, True, H[:2])
    assert idx.match(E, H, now=100) == 2 and idx.assumed_size(E) == 0
