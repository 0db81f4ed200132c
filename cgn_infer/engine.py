"""Generation: prompt in, tokens out, on one worker thread off the event loop.

Part 1 of the engine serves one request at a time, in arrival order (the
continuous-batching scheduler of issue #4 replaces `_run_one`). Each request
gets its own KV cache sized to prompt + max_tokens; the prompt is prefilled
in chunks, then tokens are decoded one by one until EOS/end-of-turn, a stop
string or token, `max_tokens`, the context limit, or cancellation (a client
that went away). Events go back to the asyncio side through a callback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cgn_infer.backends.base import Backend
from cgn_infer.detokenizer import IncrementalText
from cgn_infer.metrics import EngineMetrics
from cgn_infer.sampling import Sampled, Sampler, SamplingParams
from cgn_infer.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


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
    error: str | None = None


Event = TokenEvent | FinishEvent


@dataclass(slots=True)
class Job:
    request: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)


class Engine:
    """Owns the model and the worker thread that runs it."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: GGUFTokenizer,
        metrics: EngineMetrics,
        *,
        ctx: int,
        prefill_chunk: int = 512,
    ):
        self.backend, self.tokenizer, self.metrics = backend, tokenizer, metrics
        self.ctx = min(ctx, backend.args.ctx_len)
        self.prefill_chunk = prefill_chunk
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="cgn-infer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the current request's step, then end the worker thread."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        self.metrics.waiting.inc()
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.metrics.waiting.dec()
            if job.cancelled.is_set():
                job.emit(FinishEvent("cancelled", "", len(job.request.prompt), 0))
                continue
            self.metrics.running.inc()
            try:
                self._run_one(job)
            except Exception as exc:  # NOTE: top of the worker loop: report, keep serving
                log.exception("generation failed")
                job.emit(FinishEvent("error", "", len(job.request.prompt), 0, error=str(exc)))
                self.metrics.finished("error")
            finally:
                self.metrics.running.dec()
                self.metrics.kv_usage.set(0)

    def _run_one(self, job: Job) -> None:
        req, m = job.request, self.metrics
        prompt = list(req.prompt)
        budget = min(req.max_tokens, self.ctx - len(prompt))
        cache = self.backend.new_cache(len(prompt) + budget)
        m.kv_usage.set(len(prompt) / self.ctx)
        for start in range(0, len(prompt), self.prefill_chunk):
            if job.cancelled.is_set():
                break
            logits = self.backend.forward(prompt[start : start + self.prefill_chunk], start, cache)
        m.prompt_tokens.inc(len(prompt))
        sampler = Sampler(req.params, prompt=prompt)
        text = IncrementalText(self.tokenizer, req.stop)
        stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else self.tokenizer.stop_ids)
        last = job.enqueued
        reason: FinishReason = "length"
        n = 0
        while n < budget:
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            sampled = sampler.sample(logits)
            n += 1
            now = time.monotonic()
            (m.ttft if n == 1 else m.itl).observe(now - last)
            last = now
            if sampled.token in stop_ids:
                reason = "stop"
                break
            delta, hit = text.add(sampled.token)
            job.emit(TokenEvent(delta, sampled))
            if hit:
                reason = "stop"
                break
            if n < budget:
                logits = self.backend.forward([sampled.token], len(prompt) + n - 1, cache)
                m.kv_usage.set((len(prompt) + n) / self.ctx)
        m.generation_tokens.inc(n)
        m.e2e.observe(time.monotonic() - job.enqueued)
        m.finished("abort" if reason == "cancelled" else reason)
        job.emit(FinishEvent(reason, text.flush() if reason != "cancelled" else "", len(prompt), n))
