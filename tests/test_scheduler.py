"""The scheduler over a real block pool: exact plans, block ids, reuse, chunked prefill,
preemption, aging; and properties over random workloads driven by the sim backend."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_core.kv.blockhash import BLOCK_SIZE, block_hashes
from cgn_infer.backends.paged import BatchItem
from cgn_infer.backends.sim_backend import SimBackend, SimCost
from cgn_infer.block_pool import BlockPool
from cgn_infer.models.args import Args
from cgn_infer.scheduler import Plan, Restored, Scheduler, Seq

NS = "m"
ARGS = Args("llama", 64, 8, 1, 1, 1, 8, 8, 1e-5, 1e4, 8, False, False, 4096, True)
MODEL = SimBackend(ARGS, SimCost(), choices=list(range(10, 60)))


def toks(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


class Driver:
    """Plays the engine: runs each plan through the sim model, samples greedily, finishes
    a sequence at max_tokens, and checks the pool after every step."""

    def __init__(self, blocks: int, **kw: int) -> None:
        self.pool = BlockPool(blocks, NS)
        self.sched = Scheduler(self.pool, **kw)
        self.kv = MODEL.new_kv(blocks)
        self.plans: list[Plan] = []
        self.tables: list[list[list[int]]] = []  # per step, each work item's block table

    def step(self) -> Plan:
        plan = self.sched.schedule()
        self.plans.append(plan)
        self.tables.append([list(w.seq.table) for w in plan.work])
        for w in plan.work:  # every planned token has a block of its sequence to go to
            assert w.start + len(w.tokens) <= len(w.seq.table) * BLOCK_SIZE, (w, plan.preempted)
        for r in plan.restores:  # as the engine does: fetched blocks in before the step
            assert r.seq.restored is not None
            MODEL.write_blocks(self.kv, r.ids, r.seq.restored.data[r.first : r.first + len(r.ids)])
        if plan.work:
            items = [BatchItem(w.tokens, w.start, w.seq.table) for w in plan.work]
            logits = MODEL.forward_batch(items, self.kv)
            sampled = {
                w.seq.id: int(row.argmax())
                for w, row in zip(plan.work, logits, strict=True)
                if w.sample
            }
            self.sched.update(plan, sampled)
            for w in plan.work:
                if w.sample and len(w.seq.output) >= w.seq.max_tokens:
                    self.sched.finish(w.seq)
        self.check()
        return plan

    def run(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the workload did not finish")

    def check(self) -> None:
        """Pool accounting balances and no block is owned twice: every reference is one
        running sequence's table entry, and only full, registered blocks are shared."""
        self.pool.check()
        owners = Counter(b for s in self.sched.running for b in s.table)
        for block in self.pool.blocks:
            assert block.ref_count == owners[block.id]
            if owners[block.id] > 1:
                assert block.hash is not None
        for s in self.sched.waiting:
            assert s.table == []


def alone(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    d = Driver(256)
    seq = Seq(prompt, max_tokens)
    d.sched.add(seq)
    d.run()
    return seq.output


def test_admission_block_ids_and_commits() -> None:
    d = Driver(8)
    a = Seq(toks(0, 40), max_tokens=3)
    d.sched.add(a)
    plan = d.step()
    assert [(w.seq, w.start, len(w.tokens), w.sample) for w in plan.work] == [(a, 0, 40, True)]
    assert a.table == [0, 1, 2] and a.computed == 40 and len(a.output) == 1
    assert a.hashes == block_hashes(toks(0, 40), NS)  # two full blocks committed
    assert [d.pool.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    d.step()  # position 40 is in block 2 already
    assert a.table == [0, 1, 2]


def test_prefix_reuse_counts_cached_tokens_and_skips_their_compute() -> None:
    d = Driver(8)
    a = Seq(toks(0, 40), max_tokens=1)
    d.sched.add(a)
    d.run()
    b = Seq((*toks(0, 32), 500, 501, 502), max_tokens=1)
    d.sched.add(b)
    plan = d.step()
    assert b.cached_tokens == 32
    assert [(w.start, len(w.tokens)) for w in plan.work] == [(32, 3)]
    # b shares a's two full blocks; a's partial block 2 went back to the free list.
    assert d.tables[0] == [[0, 1, 2]] and d.tables[-1] == [[0, 1, 2]]
    assert d.pool.blocks[0].ref_count == 0 and d.pool.blocks[0].hash is not None
    # An identical prompt reuses every block but the one holding its last token.
    c = Seq(toks(0, 32), max_tokens=2)
    d.sched.add(c)
    plan = d.step()
    assert c.cached_tokens == 16 and [(w.start, len(w.tokens)) for w in plan.work] == [(16, 16)]


def test_chunked_prefill_interleaves_with_decode() -> None:
    d = Driver(16, prefill_chunk=16)
    a = Seq(toks(0, 8), max_tokens=10)
    d.sched.add(a)
    d.step()
    b = Seq(toks(100, 40), max_tokens=1)
    d.sched.add(b)
    shapes = [[(w.seq is a, len(w.tokens)) for w in d.step().work] for _ in range(3)]
    assert shapes == [[(True, 1), (False, 16)], [(True, 1), (False, 16)], [(True, 1), (False, 8)]]
    assert len(b.output) == 1 and a.output == alone(toks(0, 8), 10)[: len(a.output)]


def test_youngest_is_preempted_and_resumes_with_the_same_output() -> None:
    d = Driver(4, prefill_chunk=64)  # 64 slots: both fit at admission, not both grown
    old, young = Seq(toks(0, 24), max_tokens=20), Seq(toks(200, 8), max_tokens=20)
    d.sched.add(old)
    d.sched.add(young)
    d.run()
    preempted = [s for p in d.plans for s in p.preempted]
    assert (
        preempted and all(s is young for s in preempted) and d.sched.preemptions == len(preempted)
    )
    assert young.preemptions >= 1 and old.preemptions == 0
    assert old.output == alone(toks(0, 24), 20)
    assert young.output == alone(toks(200, 8), 20)


def test_priority_orders_the_queue_fifo_within_a_priority() -> None:
    d = Driver(64, max_batch=1, prefill_chunk=256)
    batch = [Seq(toks(100 * i, 8), max_tokens=2, priority=5) for i in range(2)]
    urgent = Seq(toks(900, 8), max_tokens=2, priority=0)
    late = Seq(toks(950, 8), max_tokens=2, priority=5)
    for seq in (*batch, urgent, late):
        d.sched.add(seq)
    assert list(d.sched.waiting) == [urgent, *batch, late]
    finished: list[Seq] = []
    while d.sched.has_work():
        for w in d.step().work:
            if w.seq.output and len(w.seq.output) >= w.seq.max_tokens:
                finished.append(w.seq)
    assert finished == [urgent, *batch, late]


def test_preemption_takes_the_highest_priority_value_first_even_when_older() -> None:
    # 5 blocks: batch holds 3 (40 tokens), urgent 1 (7 tokens), one spare. Batch takes the
    # spare first; later, with batch's decode already planned in that step, urgent needs a
    # block and finds none: batch, older but of the higher value, is the one to go.
    d = Driver(5, prefill_chunk=64)
    batch, urgent = Seq(toks(0, 40), 20, priority=2), Seq(toks(200, 7), 20, priority=0)
    d.sched.add(batch)
    d.step()  # batch is admitted first: the older in the running batch
    d.sched.add(urgent)
    d.run()  # the batch request's decode was planned before the urgent one needed a block
    preempted = [s for p in d.plans for s in p.preempted]
    assert preempted and all(s is batch for s in preempted) and urgent.preemptions == 0
    assert batch.output == alone(toks(0, 40), 20)
    assert urgent.output == alone(toks(200, 7), 20)


def test_a_preempted_request_returns_to_the_front_of_its_own_priority() -> None:
    d = Driver(64, max_batch=1, prefill_chunk=256)
    running = Seq(toks(0, 8), 4, priority=1)
    d.sched.add(running)
    d.step()
    queued = [Seq(toks(100, 4), 1, priority=p) for p in (0, 1, 2)]
    for seq in queued:
        d.sched.add(seq)
    d.sched._preempt(running)  # what a full pool does mid-decode
    assert list(d.sched.waiting) == [queued[0], running, queued[1], queued[2]]
    d.run()
    assert running.output == alone(toks(0, 8), 4)


def test_a_request_that_can_never_fit_is_refused() -> None:
    sched = Scheduler(BlockPool(2, NS))
    assert sched.fits(Seq(toks(0, 20), max_tokens=13))  # 32 slots
    with pytest.raises(ValueError, match="needs 33 KV slots, pool has 32"):
        sched.add(Seq(toks(0, 20), max_tokens=14))


def test_fifo_head_may_be_passed_only_for_aging_steps() -> None:
    d = Driver(6, aging_steps=2, prefill_chunk=256)
    hog = Seq(toks(0, 60), max_tokens=30)  # 4 blocks now, 6 at the end
    d.sched.add(hog)
    d.step()
    big = Seq(toks(300, 40), max_tokens=1)  # 3 blocks: does not fit next to hog
    d.sched.add(big)
    smalls = [Seq(toks(500 + 10 * i, 4), max_tokens=1) for i in range(4)]
    for s in smalls:
        d.sched.add(s)
    admitted = [[w.seq for w in d.step().work if w.seq is not hog] for _ in range(4)]
    assert admitted[0] == [smalls[0]] and admitted[1] == [smalls[1]]  # passing the head: 2 steps
    assert admitted[2] == [] and admitted[3] == []  # then the head blocks the queue
    assert big.skipped_steps == 4 and list(d.sched.waiting)[:1] == [big]
    d.run()
    assert big.output and all(s.output for s in smalls)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 40), st.integers(0, 2)),
        min_size=1,
        max_size=8,
    ),
    st.integers(4, 10),
    st.integers(1, 4),
    st.sampled_from([8, 16, 64]),
)
def test_random_workloads_finish_like_alone(
    specs: list[tuple[int, int, int, int]], blocks: int, max_batch: int, chunk: int
) -> None:
    """Any mix of shared prefixes, priorities, pool sizes, batch limits and chunk sizes: the
    pool stays balanced every step, and each request produces exactly what it produces alone."""
    d = Driver(blocks, max_batch=max_batch, prefill_chunk=chunk)
    seqs = []
    for family, length, max_tokens, priority in specs:
        prompt = toks(1000 * family, length)  # families share prefixes
        seq = Seq(prompt, max_tokens, priority=priority)
        if d.sched.fits(seq):
            d.sched.add(seq)
            seqs.append(seq)
    d.run()
    for seq in seqs:
        assert seq.output == alone(seq.prompt, seq.max_tokens)
    assert all(b.ref_count == 0 for b in d.pool.blocks)


def test_restored_blocks_continue_the_pool_hit_and_give_the_same_output() -> None:
    prompt = toks(0, 70)  # four full blocks before the last token
    first = Driver(16)
    ref = Seq(prompt, max_tokens=4)
    first.sched.add(ref)
    first.step()
    kv_blocks = MODEL.read_blocks(first.kv, ref.table[:4])  # as offered to kvcached
    first.run()

    d = Driver(16)
    seq = Seq(prompt, max_tokens=4, restored=Restored(0, kv_blocks, ("ram", "ram", "ssd", "ssd")))
    d.sched.add(seq)
    plan = d.step()
    assert [len(r.ids) for r in plan.restores] == [4] and plan.restores[0].first == 0
    assert [(w.start, len(w.tokens)) for w in plan.work] == [(64, 6)]  # only the tail computed
    assert seq.cached_tokens == 64 and seq.restored_tokens == {"ram": 32, "ssd": 32}
    d.run()
    assert seq.output == ref.output and seq.restored is None
    # The restored blocks were registered: the next identical prompt hits the pool.
    again = Seq(prompt, max_tokens=1)
    d.sched.add(again)
    assert not d.step().restores and again.cached_tokens == 64


def test_restored_blocks_after_a_gap_are_ignored_and_the_prompt_recomputed() -> None:
    prompt = toks(0, 70)
    src = Driver(16)
    ref = Seq(prompt, max_tokens=2)
    src.sched.add(ref)
    src.step()
    data = MODEL.read_blocks(src.kv, ref.table[1:4])
    src.run()
    d = Driver(16)  # the pool holds nothing, the fetched blocks start at block 1: a gap
    seq = Seq(prompt, max_tokens=2, restored=Restored(1, data, ("ram",) * 3))
    d.sched.add(seq)
    plan = d.step()
    assert not plan.restores and seq.cached_tokens == 0 and seq.restored_tokens == {}
    d.run()
    assert seq.output == ref.output
    # With the pool holding block 0 they continue it: blocks 1..3 restored, the rest computed.
    d2 = Driver(16)
    warm = Seq(toks(0, 17), max_tokens=1)
    d2.sched.add(warm)
    d2.run()
    seq2 = Seq(prompt, max_tokens=2, restored=Restored(1, data, ("ssd",) * 3))
    d2.sched.add(seq2)
    plan = d2.step()
    assert [(r.first, len(r.ids)) for r in plan.restores] == [(0, 3)]
    assert seq2.cached_tokens == 64 and seq2.restored_tokens == {"ssd": 48}
    d2.run()
    assert seq2.output == ref.output
