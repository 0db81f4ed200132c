"""Continuous batching over a paged KV pool: `schedule() -> Plan`, then `update(plan, sampled)`.

Pure bookkeeping (no tensors, no threads, no clocks): the engine thread calls
`schedule()`, runs the plan through the backend, samples, and reports back
with `update()`. nano-vllm / vLLM v1 style, one token budget per step:

* every running sequence whose prompt is done decodes one token per step
  (at most `max_batch` running sequences);
* the rest of the step's budget, `prefill_chunk` tokens, goes to prompts:
  first to running sequences part-way through theirs, then to waiting ones,
  admitted in FIFO order. So a long prompt is prefilled over several steps
  while the running streams keep decoding (chunked prefill);
* admission reuses every leading full block of the prompt already in the
  pool (prefix cache, cgn_core block hashes) and allocates the rest of the
  prompt's blocks at once, all or nothing; decode takes one block every 16
  tokens;
* when a decode step finds no block, the youngest running sequence is
  preempted: its blocks are released (full ones stay cached, so re-admission
  usually finds them) and it goes back to the head of the queue, keeping its
  generated tokens, which are recomputed as part of its prompt;
* a prompt may come with blocks fetched from the node's KV store
  (`Restored`, kv_tiering.py): at admission, the fetched blocks that
  continue the pool's own prefix hit go into freshly allocated blocks (the
  plan's `restores`, copied by the engine before the step runs) and count as
  computed, so the prompt is prefilled only from where they end. Fetched
  blocks that no longer join the pool's hit (it shrank meanwhile) are
  ignored: the prompt is recomputed, never wrong;
* FIFO with an aging bound: when the head of the queue does not fit, later
  requests that fit may pass it, but only for `aging_steps` steps; after
  that nothing is admitted until the head fits;
* priorities (vLLM's meaning: lower runs sooner; 0 by default) order the
  queue: a request waits behind every request of a lower or equal value, so
  FIFO holds within a priority, and a preempted request goes back to the
  front of its own priority. Preemption takes the youngest request of the
  highest value, so a batch request gives way before an interactive one.

Tunables: max_batch, prefill_chunk, aging_steps, and the pool's size.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash
from cgn_infer.block_pool import BlockId, BlockPool, PoolExhausted

SeqId = NewType("SeqId", int)
_ids = itertools.count()


PEER = "peer"  # a Restored block's tier when it came from a prefill engine


@dataclass(frozen=True, slots=True)
class Restored:
    """Prompt blocks start.. fetched from the node's KV store before admission."""

    start: int  # index of the first fetched block (the pool's prefix hit when fetched)
    data: Any  # [blocks, block bytes], the backend's serialized K/V (opaque here)
    tiers: tuple[str, ...]  # where each block was found: "ram", "ssd" or PEER

    @property
    def end(self) -> int:
        return self.start + len(self.tiers)


@dataclass(slots=True, eq=False)
class Seq:
    """One request's tokens and its place in the KV pool."""

    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0  # lower runs sooner (vLLM's convention)
    salt: str | None = None  # its tenant's KV salt (from the router): its blocks' namespace
    lora: tuple[int, float] | None = None  # its LoRA adapter's slot and scale (adapters.py)
    id: SeqId = field(default_factory=lambda: SeqId(next(_ids)))
    output: list[int] = field(default_factory=list)
    table: list[BlockId] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of table's leading full blocks
    computed: int = 0  # leading tokens whose K/V are in the pool
    cached_tokens: int = 0  # prompt tokens reused (pool or restored) at first admission
    restored: Restored | None = None  # fetched blocks, until the prefill has passed them
    stored_blocks: int = 0  # leading blocks known to be in the node's store (not offered again)
    restored_tokens: dict[str, int] = field(default_factory=dict)  # tier → tokens restored
    admitted: bool = False  # ever admitted (cached_tokens is final)
    preemptions: int = 0
    skipped_steps: int = 0  # steps this sequence, at the head of the queue, was passed over

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def need(self) -> int:
        """KV slots this request can ever need (prompt plus every generated token but the last)."""
        return len(self.prompt) + self.max_tokens - 1


@dataclass(frozen=True, slots=True)
class Work:
    """Compute `tokens` at positions start.. of `seq`; `sample`: the chunk ends the sequence's
    known tokens, so its last logits give the next token."""

    seq: Seq
    start: int
    tokens: tuple[int, ...]
    sample: bool


@dataclass(frozen=True, slots=True)
class Restore:
    """Copy rows `first`.. of `seq.restored.data` into blocks `ids` before the step runs."""

    seq: Seq
    first: int
    ids: tuple[BlockId, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    work: tuple[Work, ...]
    preempted: tuple[Seq, ...] = ()
    restores: tuple[Restore, ...] = ()


class Scheduler:
    def __init__(
        self, pool: BlockPool, *, max_batch: int = 8, prefill_chunk: int = 512, aging_steps: int = 8
    ):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be at least 1")
        self.pool = pool
        self.max_batch, self.prefill_chunk, self.aging_steps = max_batch, prefill_chunk, aging_steps
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in admission order: the last one is the youngest
        self.preemptions = 0
        self._restores: list[Restore] = []  # planned by this schedule() call

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * BLOCK_SIZE

    def fits(self, seq: Seq) -> bool:
        """Whether `seq` could ever run alone in this pool (otherwise: reject at admission)."""
        return seq.need <= self.capacity_tokens

    def require_fit(self, seq: Seq) -> None:
        """Raise ValueError when `seq` could never run in this pool."""
        if not self.fits(seq):
            raise ValueError(f"sequence needs {seq.need} KV slots, pool has {self.capacity_tokens}")

    def add(self, seq: Seq) -> None:
        """Queue `seq` behind every waiting request of a lower or equal priority value."""
        self.require_fit(seq)
        i = len(self.waiting)
        while i and self.waiting[i - 1].priority > seq.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan:
        work: list[Work] = []
        preempted: list[Seq] = []
        self._restores = []
        budget = self.prefill_chunk
        # 1. Decode: one token for every running sequence whose prompt is done.
        for seq in list(self.running):
            if seq not in self.running or seq.computed < len(seq.tokens) - 1:
                continue  # preempted by an older sequence below, or still prefilling
            while not self._reserve_slot(seq):
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim)
                # NOTE: with priorities the victim may be older than `seq`, its decode
                # already planned above: that work would write into released blocks.
                work = [w for w in work if w.seq is not victim]
                if victim is seq:
                    break
            else:
                work.append(Work(seq, seq.computed, (seq.tokens[-1],), True))
        # 2. Prompt chunks of running sequences, oldest first.
        for seq in self.running:
            if budget > 0 and seq.computed < len(seq.tokens) - 1:
                work.append(self._chunk(seq, budget))
                budget -= len(work[-1].tokens)
        # 3. Admission, FIFO with an aging bound on passing the head.
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_batch:
                break
            if not self._admit(seq):
                if seq is self.waiting[0]:
                    seq.skipped_steps += 1
                    if seq.skipped_steps > self.aging_steps:
                        break  # the head has waited long enough: nobody passes it now
                continue
            self.waiting.remove(seq)
            self.running.append(seq)
            work.append(self._chunk(seq, budget))
            budget -= len(work[-1].tokens)
        return Plan(tuple(work), tuple(preempted), tuple(self._restores))

    def update(self, plan: Plan, sampled: Mapping[SeqId, int]) -> None:
        """Record that `plan` ran: K/V written for each chunk, one token sampled where asked."""
        for w in plan.work:
            seq = w.seq
            seq.computed = w.start + len(w.tokens)
            if w.sample:
                seq.output.append(sampled[seq.id])
            self._commit_full_blocks(seq)
            if seq.restored is not None and seq.computed >= seq.restored.end * BLOCK_SIZE:
                seq.restored = None  # in the pool now; let the fetched bytes go

    def finish(self, seq: Seq) -> None:
        """Drop a finished or cancelled sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
            self.pool.release(seq.table)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.table, seq.hashes, seq.restored = [], [], None

    def _chunk(self, seq: Seq, budget: int) -> Work:
        tokens = seq.tokens
        end = min(len(tokens), seq.computed + budget)
        return Work(seq, seq.computed, tuple(tokens[seq.computed : end]), end == len(tokens))

    def _admit(self, seq: Seq) -> bool:
        tokens = seq.tokens
        # NOTE: the last token is always computed (its logits give the next one), so only
        # blocks of tokens[:-1] can be reused; the table covers every known token.
        try:
            table, reused = self.pool.admit(tokens[:-1], 1, self.pool.salted(seq.salt))
        except PoolExhausted:
            return False
        if self.pool.available < len(self.running):  # keep a block per running decode
            self.pool.release(table)
            return False
        seq.table = table
        seq.hashes = self.pool.hashes_of(table[:reused])  # hashed once, by the pool's walk
        seq.computed = self._restore(seq, reused, (len(tokens) - 1) // BLOCK_SIZE) * BLOCK_SIZE
        if not seq.admitted:
            seq.cached_tokens, seq.admitted = seq.computed, True
        seq.skipped_steps = 0
        return True

    def _restore(self, seq: Seq, reused: int, full: int) -> int:
        """Plan copying fetched blocks that continue the pool's hit of `reused` blocks (of
        `full` reusable ones); returns the blocks now counted as computed."""
        r = seq.restored
        if r is None or not r.start <= reused < r.end:
            return reused  # nothing fetched, or a gap before it: recompute from `reused`
        end = min(r.end, full)
        if end <= reused:
            return reused
        self._restores.append(Restore(seq, reused - r.start, tuple(seq.table[reused:end])))
        if PEER not in r.tiers:  # blocks from a prefill engine are not in the node's store
            seq.stored_blocks = max(seq.stored_blocks, end)
        if not seq.admitted:
            for tier in r.tiers[reused - r.start : end - r.start]:
                seq.restored_tokens[tier] = seq.restored_tokens.get(tier, 0) + BLOCK_SIZE
        return end

    def _reserve_slot(self, seq: Seq) -> bool:
        """Make sure position `seq.computed` has a block; False when the pool is exhausted."""
        if seq.computed < len(seq.table) * BLOCK_SIZE:
            return True
        try:
            seq.table += self.pool.allocate(1)
        except PoolExhausted:
            return False
        return True

    def _victim(self) -> Seq:
        """The running request to preempt: the youngest of the highest priority value."""
        return max(reversed(self.running), key=lambda s: s.priority)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.release(seq.table)
        seq.table, seq.hashes, seq.computed = [], [], 0
        seq.preemptions += 1
        self.preemptions += 1
        i = 0  # the front of its own priority
        while i < len(self.waiting) and self.waiting[i].priority < seq.priority:
            i += 1
        self.waiting.insert(i, seq)

    def _commit_full_blocks(self, seq: Seq) -> None:
        tokens = seq.tokens
        while (len(seq.hashes) + 1) * BLOCK_SIZE <= seq.computed:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            chunk: Sequence[int] = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            ns = self.pool.salted(seq.salt)
            seq.hashes.append(self.pool.commit(seq.table[i], parent, chunk, ns))
