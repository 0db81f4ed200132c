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
from typing import Any

from cgn_core.errors import Unavailable
from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.kv.client import KvCacheClient
from cgn_core.kv.events import KvEvent
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.backends.base import Backend, BackendLost
from cgn_infer.backends.paged import BatchItem
from cgn_infer.block_pool import BlockPool
from cgn_infer.detokenizer import IncrementalText
from cgn_infer.events import (
    Event,
    Exported,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    TokenEvent,
)
from cgn_infer.grammar import Grammars
from cgn_infer.kernels import loaded as loaded_kernels
from cgn_infer.kv_tiering import KvTiering, RestoreCost
from cgn_infer.metrics import EngineMetrics
from cgn_infer.sampling import Sampled, Sampler
from cgn_infer.scheduler import Plan, Restored, Scheduler, Seq, SeqId
from cgn_infer.stats import JobStats, PromptStats, QueueStats, Stats, StepStats, Tiers

log = logging.getLogger(__name__)

MAX_LOOP_FAILURES = 3  # failed loop iterations in a row that stop the worker


@dataclass(slots=True)
class Job:
    request: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    restored: Restored | None = None  # prompt blocks fetched from cgn-kvcached


@dataclass(slots=True, eq=False)
class _Active:
    """A job the scheduler knows about, with its per-request decoding state."""

    job: Job
    seq: Seq
    sampler: Sampler
    text: IncrementalText
    stop_ids: frozenset[int]
    last: float  # when the previous token (or the request) arrived
    # what its JobStats will say: its first step and token, its steps with prompt tokens
    first_step_at: float | None = None
    first_token_at: float | None = None
    prefill_steps: int = 0
    restored: Tiers | None = None  # None until its first step counts its prompt


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
        on_stats: Callable[[Stats], object] | None = None,
    ):
        """`on_stats` takes each step's and turn's stats (cgn_infer/stats.py) on the engine
        thread, to hand them to the loop; by default `metrics` consumes them there."""
        self.backend, self.tokenizer, self.metrics = backend, tokenizer, metrics
        self._report = on_stats or metrics.observe
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
        # temperature draws in C where the backend loaded the kernels (any backend then)
        kernels = loaded_kernels()
        self._sample_lib = kernels.lib if kernels is not None else None
        # The node's KV store (cgn-kvcached): blocks offered after requests, prompts restored.
        self.tiering: KvTiering | None = None
        if kvcache is not None:
            # a simulated backend's blocks stand for the modelled engine's bigger ones
            block_bytes = backend.kv_bytes_per_token() * BLOCK_SIZE
            self.tiering = KvTiering(
                kvcache,
                backend,
                self.pool,
                metrics,
                restore_cost or RestoreCost(),
                modelled_block_bytes=block_bytes if backend.modelled else None,
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
            req.prompt + req.resumed,
            req.max_tokens,
            priority=req.priority,
            salt=req.salt,
            lora=req.lora,
            restored=job.restored,
        )
        self.scheduler.require_fit(seq)  # the server checks first; this is the backstop
        with self._gate:
            if (failure := self.failure) is not None:
                raise Unavailable(f"the engine's worker stopped: {failure}")
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
        if plan.work:
            self._step(plan)
        else:
            if plan.preempted:
                self._report(StepStats(0, 0, len(plan.preempted), (), (), ()))
            if self.scheduler.has_work():  # nothing fits this step; wait for a change
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
                    Sampler(req.params, prompt=req.prompt, lib=self._sample_lib),
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
        items = [BatchItem(w.tokens, w.start, w.seq.table, w.seq.lora) for w in plan.work]
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
        if self.tiering is not None and prefill >= 4 * BLOCK_SIZE and not plan.restores:
            self.tiering.observe_prefill(prefill, time.monotonic() - started)
        prompts: list[PromptStats] = []
        for w in plan.work:
            active = self._active[w.seq.id]
            if len(w.tokens) > 1 or active.restored is None:
                active.prefill_steps += 1
            if active.first_step_at is None:
                active.first_step_at = started
            if active.restored is None:  # its first step: its prompt counts
                active.restored = tiers = tuple(w.seq.restored_tokens.items())
                hits = w.seq.cached_tokens - sum(n for _, n in tiers)
                prompts.append(PromptStats(len(w.seq.prompt), hits, tiers))
        sampled, failed = self._sample(plan, logits, masks)
        if failed:
            for active, why, theirs in failed:
                self._finish(active, "error", error=why, client_fault=theirs)
            gone = {a.seq.id for a, _, _ in failed}
            plan = Plan(tuple(w for w in plan.work if w.seq.id not in gone), plan.preempted)
        self.scheduler.update(plan, {sid: s.token for sid, s in sampled.items()})
        now = time.monotonic()
        firsts: list[float] = []
        gaps: list[float] = []
        for sid in sampled:
            active = self._active[sid]
            (firsts if len(active.seq.output) == 1 else gaps).append(now - active.last)
        # NOTE: before the tokens: the loop counts the step before it relays them
        stats = StepStats(
            len(plan.work), prefill, len(plan.preempted), (*prompts,), (*firsts,), (*gaps,)
        )
        self._report(stats)
        for sid, s in sampled.items():
            self._emit_token(self._active[sid], s, now)

    def _sample(
        self, plan: Plan, logits: Any, masks: Future[dict[SeqId, Any]] | None
    ) -> tuple[dict[SeqId, Sampled], list[tuple[_Active, str, bool]]]:
        """The tokens of the rows this step samples, and the sequences that failed: (why,
        whether it is the request's fault: its grammar cannot go on)."""
        sampled: dict[SeqId, Sampled] = {}
        failed: list[tuple[_Active, str, bool]] = []
        for w, row in zip(plan.work, logits, strict=True):
            if not w.sample:
                continue
            active = self._active[w.seq.id]
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
        return sampled, failed

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
        seq = active.seq
        if active.first_token_at is None:
            active.first_token_at = now
        active.last = now
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
        seq, job = active.seq, active.job
        del self._active[seq.id]
        stats = JobStats(
            reason,
            job.enqueued,
            time.monotonic(),
            active.first_step_at,
            active.first_token_at,
            active.prefill_steps,
            active.restored or (),
        )
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
                stats=stats,
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
        s = self.scheduler
        self._report(
            QueueStats(len(s.running), len(s.waiting) + self._jobs.qsize(), self.pool.usage)
        )
        events = self.pool.drain_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)
