"""Generation: many requests at once on one worker thread, off the event loop.

Each step the scheduler (scheduler.py) plans which sequences run and which
prompt chunks are prefilled; the backend runs the whole plan as one batch over
the paged KV pool; the engine samples, detokenizes, checks stop conditions and
reports back. A sequence ends on EOS/end-of-turn, a stop string or token,
`max_tokens`, or cancellation (a client that went away). Events go back to the
asyncio side through each job's callback; KV-cache events through
`on_kv_events`.

Failure containment (NOTE: one request must never stop the others): a job
whose per-request state cannot be built, or whose sampling fails, ends alone
with an "error" finish; a batch step that fails ends that batch's sequences;
any other exception in an iteration fails the requests then active and the
loop goes on, except `BackendLost` (a pipeline stage is gone), which stops the worker at
once. Only `MAX_LOOP_FAILURES` failed iterations in a row (a broken
invariant, not a bad request) stop the worker: every pending job then ends
with an error, `failure` says why (the server's /health answers 503 with it,
so the agent restarts the engine) and `submit` refuses new work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

from cgn_core.errors import Unavailable
from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash
from cgn_core.kv.client import KvCacheClient
from cgn_core.kv.events import KvEvent
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.backends.base import Backend, BackendLost
from cgn_infer.backends.paged import BatchItem
from cgn_infer.block_pool import BlockPool
from cgn_infer.detokenizer import IncrementalText
from cgn_infer.grammar import Constraint, Grammars
from cgn_infer.kv_tiering import KvTiering, RestoreCost
from cgn_infer.metrics import EngineMetrics
from cgn_infer.sampling import Sampled, Sampler, SamplingParams
from cgn_infer.scheduler import Plan, Restored, Scheduler, Seq, SeqId

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_LOOP_FAILURES = 3  # failed loop iterations in a row that stop the worker


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0  # lower runs sooner
    export_kv: bool = False  # a prefill leg: hand back the prompt's full KV blocks at the end
    constraint: Constraint | None = None  # a grammar the output must follow (its own state)
    # a continuation (cgn_core/openai/resume.py): tokens another engine generated, computed
    # after the prompt and counted as output; max_tokens is what is left to generate
    resumed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One decoded token: the text it completed (maybe ''), and how it was sampled."""

    text: str
    sampled: Sampled


@dataclass(frozen=True, slots=True)
class FinishEvent:
    reason: FinishReason
    text: str  # the last held-back text, emitted at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None
    # the error is the request's: its grammar hit llguidance's limits (a 400, not a 500)
    client_fault: bool = False
    exported: Exported | None = None  # export_kv: the prompt's blocks, read before release


@dataclass(frozen=True, slots=True)
class Exported:
    """A prompt's full blocks (all but the block holding its last token, which the decode
    engine computes itself), as the backend serializes them."""

    hashes: tuple[BlockHash, ...]
    data: Any  # [blocks, block bytes] uint8


Event = TokenEvent | FinishEvent


@dataclass(slots=True)
class Job:
    request: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    restored: Restored | None = None  # prompt blocks fetched from cgn-kvcached
    # When its first step began and its first token came, its steps with prompt tokens (the
    # request's trace reads them after its FinishEvent; written on the engine thread)
    first_step_at: float | None = None
    first_token_at: float | None = None
    prefill_steps: int = 0
    restored_tokens: dict[str, int] = field(default_factory=dict)  # tier → prompt tokens


@dataclass(slots=True, eq=False)
class _Active:
    """A job the scheduler knows about, with its per-request decoding state."""

    job: Job
    seq: Seq
    sampler: Sampler
    text: IncrementalText
    stop_ids: frozenset[int]
    last: float  # when the previous token (or the request) arrived
    counted: bool = False  # prompt and prefix-cache metrics recorded


@dataclass(frozen=True, slots=True)
class EngineConfig:
    ctx: int
    kv_pool_tokens: int = 16384
    max_batch: int = 8
    prefill_chunk: int = 512
    aging_steps: int = 8


class Engine:
    """Owns the model, the KV pool, the scheduler and the worker thread that runs them."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: GGUFTokenizer,
        metrics: EngineMetrics,
        config: EngineConfig,
        *,
        namespace: str,
        on_kv_events: Callable[[list[KvEvent]], object] | None = None,
        executor: ThreadPoolExecutor | None = None,
        kvcache: KvCacheClient | None = None,
        restore_cost: RestoreCost | None = None,
        grammars: Grammars | None = None,
    ):
        self.backend, self.tokenizer, self.metrics = backend, tokenizer, metrics
        self.grammars = grammars
        # NOTE: masks are computed here while the forward pass runs (llguidance drops the GIL)
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="cgn-infer-grammar")
        self.ctx = min(config.ctx, backend.args.ctx_len)
        blocks = max(1, config.kv_pool_tokens // BLOCK_SIZE)
        self.pool = BlockPool(blocks, namespace)
        self.kv = backend.new_kv(blocks)
        metrics.kv_pool_bytes.set(backend.kv_nbytes(self.kv))
        metrics.kv_pool_tokens.set(blocks * BLOCK_SIZE)
        self.scheduler = Scheduler(
            self.pool,
            max_batch=config.max_batch,
            prefill_chunk=config.prefill_chunk,
            aging_steps=config.aging_steps,
        )
        self.on_kv_events = on_kv_events
        # The node's KV store (cgn-kvcached): blocks offered after requests, prompts restored.
        self.tiering: KvTiering | None = None
        if kvcache is not None:
            modelled = backend.kv_bytes_per_token() * BLOCK_SIZE
            sim = modelled != kvcache.layout.block_bytes  # the sim's blocks stand for bigger ones
            self.tiering = KvTiering(
                kvcache,
                backend,
                self.pool,
                metrics,
                restore_cost or RestoreCost(),
                modelled_block_bytes=modelled if sim else None,
            )
        self._active: dict[SeqId, _Active] = {}
        self._jobs: queue.Queue[tuple[Job, Seq] | None] = queue.Queue()
        self._stopping = False
        # NOTE: pass the one-thread executor that loaded the model: torch's OpenMP team
        # belongs to the thread that made it, and a second thread's team ran batched steps
        # up to 40% slower on 2 cores (measured).
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="cgn-infer-engine")
        self._done: Future[None] | None = None
        self._gate = threading.Lock()  # orders submit() against the worker's death
        self._failure: str | None = None  # why the worker stopped; None while it serves

    @property
    def failure(self) -> str | None:
        """Why this engine cannot serve: its worker stopped, or a part of its backend outside
        this process is gone (a pipeline stage, noticed between steps too); None while it
        serves."""
        if self._failure is not None:
            return self._failure
        lost = self.backend.lost
        return f"BackendLost: {lost}" if lost else None

    @property
    def restore_executor(self) -> ThreadPoolExecutor | None:
        """Where fetching a prompt's blocks runs (off the event loop): the node store's
        restore threads, or the loop's default executor without a store."""
        return self.tiering.restorer if self.tiering is not None else None

    @property
    def capacity_tokens(self) -> int:
        """The most KV slots one request may need (prompt + max_tokens - 1)."""
        return self.scheduler.capacity_tokens

    def start(self) -> None:
        self._done = self._executor.submit(self._loop)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the current step, cancel what is left, then end the worker thread."""
        self._jobs.put(None)
        if self._done is not None:
            wait([self._done], timeout_s)
        self._executor.shutdown(wait=False)
        self._masker.shutdown(wait=False)
        if self.tiering is not None:
            self.tiering.close()

    def submit(self, job: Job) -> None:
        """Queue `job`; Unavailable once the worker has stopped for good."""
        req = job.request
        seq = Seq(
            req.prompt + req.resumed, req.max_tokens, priority=req.priority, restored=job.restored
        )
        self.scheduler.require_fit(seq)  # the server checks first; this is the backstop
        with self._gate:
            if (failure := self.failure) is not None:
                raise Unavailable(f"the engine's worker stopped: {failure}")
            self.metrics.waiting.inc()
            self._jobs.put((job, seq))

    # ---- the worker thread ----------------------------------------------------------

    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                try:
                    self._iterate()
                    failures = 0
                except BackendLost:  # no step can run any more: stop now, say why
                    raise
                except Exception as exc:  # NOTE: top of the worker loop
                    failures += 1
                    log.exception("engine loop iteration failed (%d in a row)", failures)
                    if failures >= MAX_LOOP_FAILURES:
                        raise
                    self._fail_active(f"internal error: {type(exc).__name__}: {exc}")
        except BaseException as exc:
            self._die(f"{type(exc).__name__}: {exc}")
            raise
        for active in list(self._active.values()):
            self._finish(active, "cancelled")
        self._publish()

    def _iterate(self) -> None:
        """One turn: take new jobs, plan a step, run it, publish gauges and KV events."""
        self._take_jobs(block=not self.scheduler.has_work())
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        if plan.work:
            self._step(plan)
        elif self.scheduler.has_work():  # nothing fits this step; wait for a change
            self._take_jobs(block=True, timeout_s=0.01)
        self._publish()

    def _fail_active(self, error: str) -> None:
        """End every active request with `error` (after an iteration failed under them)."""
        for active in list(self._active.values()):
            self._finish(active, "error", error=error)

    def _die(self, reason: str) -> None:
        """The worker is stopping for good: end every job it holds or that is queued."""
        log.critical("the engine's worker stopped: %s", reason)
        with self._gate:
            self._failure = reason
        jobs = [a.job for a in self._active.values()]
        self._active.clear()
        while True:
            try:
                entry = self._jobs.get_nowait()
            except queue.Empty:
                break
            if entry is not None:
                jobs.append(entry[0])
        for job in jobs:
            n = len(job.request.prompt)
            job.emit(FinishEvent("error", "", n, 0, error=f"the engine stopped: {reason}"))

    def _take_jobs(self, *, block: bool, timeout_s: float | None = None) -> None:
        while True:
            try:
                entry = self._jobs.get(block=block, timeout=timeout_s)
            except queue.Empty:
                return
            block = False
            if entry is None:
                self._stopping = True
                return
            job, seq = entry
            req = job.request
            eos = frozenset() if req.ignore_eos else self.tokenizer.stop_ids
            try:
                active = _Active(
                    job,
                    seq,
                    Sampler(req.params, prompt=req.prompt),
                    IncrementalText(self.tokenizer, req.stop),
                    req.stop_token_ids | eos,
                    job.enqueued,
                )
                active.sampler.resume(req.resumed)
                for token in req.resumed:  # the text a client already has, as it had it
                    active.text.add(token)
            except Exception as exc:  # NOTE: a request the server let through; it alone fails
                log.exception("could not start a request")
                n, done = len(req.prompt), len(req.resumed)
                job.emit(FinishEvent("error", "", n, done, error=f"{type(exc).__name__}: {exc}"))
                continue
            self._active[seq.id] = active
            self.scheduler.add(seq)

    def _drop_cancelled(self) -> None:
        for active in list(self._active.values()):
            if active.job.cancelled.is_set():
                self._finish(active, "cancelled")

    def _step(self, plan: Plan) -> None:
        items = [BatchItem(w.tokens, w.start, w.seq.table) for w in plan.work]
        prefill = sum(len(w.tokens) for w in plan.work if len(w.tokens) > 1)
        started = time.monotonic()
        masks = self._masks(plan)
        try:
            for r in plan.restores:  # fetched blocks into the pool before anything reads them
                assert r.seq.restored is not None
                rows = r.seq.restored.data[r.first : r.first + len(r.ids)]
                self.backend.write_blocks(self.kv, r.ids, rows)
            logits = self.backend.forward_batch(items, self.kv)
        except BackendLost:
            raise
        except Exception as exc:  # NOTE: top of the worker loop: fail this batch, keep serving
            log.exception("a batch step failed")
            for w in plan.work:
                self._finish(self._active[w.seq.id], "error", error=str(exc))
            return
        m = self.metrics
        m.step_sequences.observe(len(plan.work))
        m.prefill_computed.inc(prefill)
        if self.tiering is not None and prefill >= 4 * BLOCK_SIZE and not plan.restores:
            self.tiering.observe_prefill(prefill, time.monotonic() - started)
        sampled: dict[SeqId, Sampled] = {}
        failed: list[tuple[_Active, str, bool]] = []  # (sequence, why, the request's fault)
        for w, row in zip(plan.work, logits, strict=True):
            active = self._active[w.seq.id]
            if len(w.tokens) > 1 or not active.counted:
                active.job.prefill_steps += 1
            if active.job.first_step_at is None:
                active.job.first_step_at = started
            if not active.counted:
                active.counted = True
                m.prompt_tokens.inc(len(w.seq.prompt))
                m.prefix_queries.inc(len(w.seq.prompt))
                restored = w.seq.restored_tokens
                active.job.restored_tokens = dict(restored)
                m.prefix_hits.inc(w.seq.cached_tokens - sum(restored.values()))
                for tier, n in restored.items():
                    m.restored(tier, n)
            if w.sample:
                try:
                    constraint = active.job.request.constraint
                    allowed = None
                    if constraint is not None and masks is not None:
                        allowed = masks.result()[w.seq.id]
                    s = active.sampler.sample(row, allowed)
                    if constraint is not None and (refused := constraint.advance(s.token)):
                        why = f"the structured output constraint cannot go on: {refused}"
                        failed.append((active, " ".join(why.split())[:300], True))
                        if self.grammars is not None:
                            self.grammars.forget(constraint.key)
                        continue
                    sampled[w.seq.id] = s
                except Exception as exc:  # NOTE: this sequence alone fails
                    log.exception("sampling failed for one sequence")
                    failed.append((active, f"sampling failed: {type(exc).__name__}: {exc}", False))
        if failed:
            for active, why, theirs in failed:
                self._finish(active, "error", error=why, client_fault=theirs)
            gone = {a.seq.id for a, _, _ in failed}
            plan = Plan(tuple(w for w in plan.work if w.seq.id not in gone), plan.preempted)
        self.scheduler.update(plan, {sid: s.token for sid, s in sampled.items()})
        now = time.monotonic()
        for sid, s in sampled.items():
            self._emit_token(self._active[sid], s, now)

    def _masks(self, plan: Plan) -> Future[dict[SeqId, Any]] | None:
        """The grammar masks of the rows this step samples under a constraint, computed on
        the masking thread while the forward pass runs (None: no such row)."""
        rows = [
            (w.seq.id, c)
            for w in plan.work
            if w.sample and (c := self._active[w.seq.id].job.request.constraint) is not None
        ]
        if not rows or self.grammars is None:
            return None
        grammars = self.grammars

        def fill() -> dict[SeqId, Any]:
            masks = grammars.fill([c for _, c in rows])
            return {sid: grammars.allowed(m) for (sid, _), m in zip(rows, masks, strict=True)}

        return self._masker.submit(fill)

    def _emit_token(self, active: _Active, sampled: Sampled, now: float) -> None:
        m, seq = self.metrics, active.seq
        (m.ttft if len(seq.output) == 1 else m.itl).observe(now - active.last)
        if active.job.first_token_at is None:
            active.job.first_token_at = now
        active.last = now
        m.generation_tokens.inc()
        if len(seq.output) == 1 and self.tiering is not None:
            # NOTE: the prompt's blocks go to the node's store as soon as they are computed,
            # not only at the end: an answer this engine does not live to finish continues
            # elsewhere from them (request migration)
            self._offer(seq)
        if sampled.token in active.stop_ids:
            self._finish(active, "stop")
            return
        delta, hit = active.text.add(sampled.token)
        active.job.emit(TokenEvent(delta, sampled))
        constraint = active.job.request.constraint
        if hit or (constraint is not None and constraint.done):
            self._finish(active, "stop")
        elif len(seq.output) >= seq.max_tokens:
            self._finish(active, "length")

    def _finish(
        self,
        active: _Active,
        reason: FinishReason,
        error: str | None = None,
        client_fault: bool = False,
    ) -> None:
        seq, m = active.seq, self.metrics
        del self._active[seq.id]
        m.e2e.observe(time.monotonic() - active.job.enqueued)
        m.finished("abort" if reason == "cancelled" else reason)
        tail = active.text.flush() if reason in ("stop", "length") else ""
        exported = None
        if active.job.request.export_kv and reason in ("stop", "length"):
            exported = self._export(seq)
        resumed = len(active.job.request.resumed)
        active.job.emit(
            FinishEvent(
                reason,
                tail,
                len(seq.prompt) - resumed,
                resumed + len(seq.output),
                seq.cached_tokens,
                error=error,
                client_fault=client_fault,
                exported=exported,
            )
        )
        # NOTE: after the client has its answer, before the blocks go back to the pool
        if self.tiering is not None and reason != "error":
            self._offer(seq)
        self.scheduler.finish(seq)

    def _offer(self, seq: Seq) -> None:
        """The sequence's full blocks to the node's store (those not offered before)."""
        assert self.tiering is not None
        if not seq.hashes:
            return
        try:
            self.tiering.offer(self.kv, seq)
        except Exception:  # NOTE: an offer is an optimisation; the request goes on regardless
            log.exception("could not offer a sequence's blocks")

    def _export(self, seq: Seq) -> Exported | None:
        """A prefill leg's prompt blocks, read out of the pool; None if that fails (the leg
        then names no KV and the decode replica computes the prompt itself)."""
        full = min((len(seq.prompt) - 1) // BLOCK_SIZE, len(seq.hashes))
        if full == 0:
            return Exported((), None)
        try:
            return Exported(
                tuple(seq.hashes[:full]), self.backend.read_blocks(self.kv, seq.table[:full])
            )
        except Exception:  # NOTE: under _finish: one request's export must not stop the loop
            log.exception("could not read a prefill leg's blocks out of the pool")
            return None

    def _publish(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting) + self._jobs.qsize())
        m.kv_usage.set(self.pool.usage)
        events = self.pool.drain_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)
