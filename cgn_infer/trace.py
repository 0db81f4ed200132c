"""One request's spans in cgn-infer (cgn_core/tracing.py has the tracer and its sampling).

    chat SmolLM2              SERVER, continuing the router's `traceparent`
    ├ prepare                 template, tokenize, grammar compile (`cognitora.grammar.compiled`)
    ├ kv restore              blocks fetched before queueing: from cgn-kvcached or, for a P/D
    │                         decode leg, from the prefill engine (blocks, tiers, the note)
    ├ queue                   submitted → its first step
    ├ prefill                 first step → first token: prompt tokens computed, from the
    │                         prefix cache, restored by tier; steps it took (chunks)
    └ decode                  first token → the end: tokens, steps

The engine thread stamps the job (first step, first token, prefill steps);
the spans are made on the event loop from those stamps once the request
ends, with their real start and end times. Never recorded: prompt or answer.
`GenerationTrace.OFF` stands in when tracing is off; an unsampled request
makes a root span only if it fails (cgn_core/tracing.py, "Sampling").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from cgn_core.tracing import Incoming, Tracer, failed
from cgn_infer.events import FinishEvent
from cgn_infer.scheduler import Restored
from cgn_infer.stats import JobStats

OPERATIONS = {"chat": "chat", "completion": "text_completion"}


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant as ns since the epoch (what spans are stamped with)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class GenerationTrace:
    """Tracing off: every method a no-op. `start` gives a `_Sampled` trace (every span) or
    an `_Unsampled` one (a root span only if the request fails)."""

    OFF: GenerationTrace

    @staticmethod
    def start(
        tracer: Tracer | None, kind: str, model: str, headers: Mapping[str, str]
    ) -> GenerationTrace:
        if tracer is None:
            return GenerationTrace.OFF
        incoming = tracer.incoming(headers)
        operation = OPERATIONS.get(kind, kind)
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
        if incoming.sampled:
            return _Sampled(tracer, incoming.context, f"{operation} {model}", attributes)
        return _Unsampled(tracer, incoming, f"{operation} {model}", attributes)

    def clock(self) -> float:
        return 0.0

    def step(self, name: str, since: float, **attributes: Any) -> None:
        """A child span from `since` (monotonic) to now."""

    def restoring(self) -> tuple[Any, dict[str, str] | None]:
        """The KV restore span, started (or None), and the trace context for the calls it
        makes (kvcached's Get joins the request's trace)."""
        return None, None

    def restored(self, span: Any, restored: Restored | None, note: str | None) -> None:
        """End the KV restore span: blocks fetched before queueing, where from."""

    def generated(self, job: JobStats, ev: FinishEvent) -> None:
        """The queue, prefill and decode spans of a finished job."""

    def finish(self, status: int, error: str = "") -> None:
        """End the request's trace with its outcome."""


GenerationTrace.OFF = GenerationTrace()


class _Sampled(GenerationTrace):
    def __init__(self, tracer: Tracer, ctx: Any, name: str, attributes: dict[str, Any]):
        self.tracer = tracer
        self.root = tracer.start(name, ctx, kind="server", attributes=attributes)

    def clock(self) -> float:
        return time.monotonic()

    def step(self, name: str, since: float, **attributes: Any) -> None:
        span = self.tracer.start(name, self.root, start_ns=epoch_ns(since))
        span.set_attributes({f"cognitora.{k}": v for k, v in attributes.items()})
        span.end()

    def restoring(self) -> tuple[Any, dict[str, str] | None]:
        span = self.tracer.start("kv restore", self.root)
        return span, self.tracer.headers(span)

    def restored(self, span: Any, restored: Restored | None, note: str | None) -> None:
        tiers = restored.tiers if restored is not None else ()
        span.set_attributes(
            {"cognitora.kv.blocks": len(tiers), "cognitora.kv.tiers": ",".join(sorted(set(tiers)))}
        )
        if note:
            span.set_attribute("cognitora.kv.transfer", note)
        span.end()

    def generated(self, job: JobStats, ev: FinishEvent) -> None:
        end = job.finished
        first_step = job.first_step_at or end
        first_token = job.first_token_at or end
        restored = sum(n for _, n in job.restored)
        prefill: dict[str, Any] = {
            "cognitora.prefill.tokens_computed": ev.prompt_tokens - ev.cached_tokens,
            "cognitora.prefill.tokens_cached": ev.cached_tokens - restored,
            "cognitora.prefill.steps": job.prefill_steps,
        }
        for tier, n in job.restored:
            prefill[f"cognitora.prefill.tokens_restored.{tier}"] = n
        decode = {
            "gen_ai.usage.output_tokens": ev.completion_tokens,
            "cognitora.decode.steps": max(0, ev.completion_tokens - 1),
        }
        spans: tuple[tuple[str, float, float, dict[str, Any]], ...] = (
            ("queue", job.enqueued, first_step, {}),
            ("prefill", first_step, first_token, prefill),
            ("decode", first_token, end, decode),
        )
        for name, start, stop, attributes in spans:
            span = self.tracer.start(name, self.root, start_ns=epoch_ns(start))
            span.set_attributes(attributes)
            span.end(epoch_ns(stop))
        self.root.set_attributes(_usage(job, ev))
        if ev.reason == "error":
            failed(self.root, "generation_error")

    def finish(self, status: int, error: str = "") -> None:
        self.root.set_attribute("http.response.status_code", status)
        if error:
            failed(self.root, error)
        self.root.end()


class _Unsampled(GenerationTrace):
    """No spans; the root's attributes kept in case the request fails."""

    def __init__(self, tracer: Tracer, incoming: Incoming, name: str, attributes: dict[str, Any]):
        self.tracer = tracer
        self.incoming = incoming
        self.name = name
        self.attributes = attributes
        self.started_ns = time.time_ns()
        self.error = ""

    def restoring(self) -> tuple[Any, dict[str, str] | None]:
        return None, self.incoming.headers()

    def generated(self, job: JobStats, ev: FinishEvent) -> None:
        self.attributes.update(_usage(job, ev))
        if ev.reason == "error":
            self.error = "generation_error"

    def finish(self, status: int, error: str = "") -> None:
        if error or self.error:
            attributes = {**self.attributes, "http.response.status_code": status}
            why = error or self.error
            self.tracer.failed_root(self.name, self.incoming, self.started_ns, attributes, why)


def _usage(job: JobStats, ev: FinishEvent) -> dict[str, Any]:
    first_token = job.first_token_at or job.finished
    return {
        "gen_ai.usage.input_tokens": ev.prompt_tokens,
        "gen_ai.usage.output_tokens": ev.completion_tokens,
        "gen_ai.response.finish_reasons": (ev.reason,),
        "gen_ai.server.time_to_first_token": first_token - job.enqueued,
    }
