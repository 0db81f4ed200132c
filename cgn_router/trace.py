"""One request's spans in the router (cgn_core/tracing.py has the tracer and its sampling).

    chat SmolLM2                      SERVER, the request: model, served model, band,
    ├ admission                       tenant, key id, TTFT, usage, status
    ├ route                           candidates, chosen endpoint, matched blocks by tier,
    │                                 the scorer that decided, predicted TTFTs (time scorer),
    │                                 prompt tokens from the prefix cache (tokens_reused)
    ├ prefill leg (P/D)               CLIENT, to the prefill replica
    ├ upstream                        CLIENT, one per attempt: endpoint, outcome; its
    │                                 `traceparent` goes to the engine, whose spans follow
    └ upstream (continuation)         a broken stream continued elsewhere (migration)

Attributes follow OpenTelemetry's `gen_ai.*` conventions where they apply
(operation, request and response model, usage, time to first token). Never
recorded: the API key, the prompt, the answer.

A request's trace is one of its observers (cgn_router/routing/lifecycle.py): it
makes its spans from the request's records, and answers an attempt's start
with the headers that carry the trace to the engine. With tracing off a
request has no trace observer at all. An unsampled request makes no spans;
only its root, if it fails (cgn_core/tracing.py, "Sampling").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cgn_core.tracing import Incoming, Tracer, failed, now_ns
from cgn_router.routing.chain import Decision
from cgn_router.routing.lifecycle import (
    Admitted,
    Asked,
    AttemptEnded,
    AttemptStarted,
    Ended,
    Hashed,
    Record,
    Routed,
)

PREDICTED_CANDIDATES = 8  # candidates whose predictions a route span carries, soonest first
OPERATIONS = {"chat": "chat", "completion": "text_completion", "embeddings": "embeddings"}


class RequestTrace:
    """The spans of one request. This base class is tracing off (every method a no-op);
    `start` gives a `_Sampled` one (every span) or an `_Unsampled` one (a root span only if
    the request fails; cgn_core/tracing.py, "Sampling")."""

    OFF: RequestTrace

    @staticmethod
    def start(tracer: Tracer | None, kind: str, headers: Mapping[str, str]) -> RequestTrace:
        """A request's trace, continuing the client's `traceparent` (if any); its root is
        named for the model by `asked` once the body is read."""
        if tracer is None:
            return RequestTrace.OFF
        incoming = tracer.incoming(headers)
        operation = OPERATIONS[kind]
        if incoming.sampled:
            return _Sampled(tracer, incoming.context, operation)
        return _Unsampled(tracer, incoming, operation)

    def observe(self, record: Record) -> Mapping[str, str] | None:
        """One of the request's records as its spans; an attempt's start is answered with the
        headers that carry the trace upstream."""
        match record:
            case AttemptStarted():
                return self._attempt_started(record)
            case AttemptEnded():
                self._attempt_ended(record)
                if record.leg == "client":
                    self.served(record.model, record.first_byte_s)
            case Routed():
                self.routed(record.decision, record.role, record.weights, record.took_ns)
            case Asked():
                self.asked(record.asked, record.tenant, record.band, record.key_id)
            case Admitted():
                self.admitted(record.waited_s)
            case Hashed():
                self.hashed(record.reused or 0)
            case Ended():
                u = record.usage
                self.finish(
                    record.status,
                    None if u is None else (u.prompt_tokens, u.completion_tokens),
                    record.error,
                )
        return None

    def _attempt_started(self, record: AttemptStarted) -> Mapping[str, str] | None:
        return self.upstream(record.name, record.endpoint, record.url)[1]

    def _attempt_ended(self, record: AttemptEnded) -> None:
        pass

    def asked(self, model: str, tenant: str, band: str, key_id: str) -> None:
        """What the body asked for, and who asked (never the key itself)."""
        self._name(model)
        self._note(
            {
                "gen_ai.request.model": model,
                "cognitora.tenant": tenant,
                "cognitora.band": band,
                "cognitora.key.id": key_id,
            }
        )

    def served(self, model: str, ttft_s: float | None) -> None:
        """The model that answered, and the time to the client's first byte (None: no byte
        went out)."""
        self._note({"gen_ai.response.model": model})
        if ttft_s is not None:
            self._note({"gen_ai.server.time_to_first_token": ttft_s})

    def admitted(self, waited_s: float) -> None:
        """The admission span: the time the request queued (ending now)."""

    def hashed(self, reused: int) -> None:
        """The prompt's tokens taken from the prefix cache (on the route span)."""

    def routed(
        self, decision: Decision, role: str, weights: Mapping[str, float], took_ns: int
    ) -> None:
        """The route span: what the chain saw and chose for a replica of `role` (both,
        prefill, decode), in the `took_ns` before now."""

    def upstream(self, name: str, endpoint: str, url: str) -> tuple[Any, dict[str, str] | None]:
        """A started CLIENT span for a call to an engine (or None), and the headers that carry
        the trace to it."""
        return None, None

    def finish(self, status: int, usage: tuple[int, int] | None = None, error: str = "") -> None:
        """End the request's trace with its outcome."""

    def _name(self, model: str) -> None:
        pass

    def _note(self, attributes: Mapping[str, Any]) -> None:
        pass


RequestTrace.OFF = RequestTrace()


def _outcome(status: int, usage: tuple[int, int] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"http.response.status_code": status}
    if usage is not None:
        out["gen_ai.usage.input_tokens"], out["gen_ai.usage.output_tokens"] = usage
    return out


class _Sampled(RequestTrace):
    def __init__(self, tracer: Tracer, ctx: Any, operation: str):
        self.tracer = tracer
        self.root = tracer.start(
            operation, ctx, kind="server", attributes={"gen_ai.operation.name": operation}
        )
        self.attempts: dict[int, Any] = {}  # attempt -> its upstream span, until it ends
        self.reused = 0  # prompt tokens from the prefix cache

    def _attempt_started(self, record: AttemptStarted) -> Mapping[str, str] | None:
        span, headers = self.upstream(record.name, record.endpoint, record.url)
        self.attempts[record.attempt] = span
        return headers

    def _attempt_ended(self, record: AttemptEnded) -> None:
        end_upstream(self.attempts.pop(record.attempt, None), record.outcome, record.cause)

    def hashed(self, reused: int) -> None:
        self.reused = reused

    def admitted(self, waited_s: float) -> None:
        end = now_ns()
        span = self.tracer.start("admission", self.root, start_ns=end - int(waited_s * 1e9))
        span.set_attribute("cognitora.admission.wait_s", waited_s)
        span.end(end)

    def routed(
        self, decision: Decision, role: str, weights: Mapping[str, float], took_ns: int
    ) -> None:
        span = self.tracer.start("route", self.root, start_ns=now_ns() - took_ns)
        span.set_attribute("cognitora.route.candidates", len(decision.totals))
        span.set_attribute("cognitora.route.role", role)
        span.set_attribute("cognitora.route.tokens_reused", self.reused)
        view = decision.view
        if view is not None:
            span.set_attributes(
                {
                    "cognitora.route.endpoint": view.id,
                    "cognitora.route.matched_blocks.engine": view.matched_blocks,
                    "cognitora.route.matched_blocks.node_ram": view.node_ram_blocks,
                    "cognitora.route.matched_blocks.node_ssd": view.node_ssd_blocks,
                    "cognitora.route.decided_by": decided_by(decision, weights),
                }
            )
        else:
            span.set_attribute("cognitora.route.endpoint", "")
        if decision.predicted_s:
            span.set_attributes(predictions(decision))
        span.end()

    def upstream(self, name: str, endpoint: str, url: str) -> tuple[Any, dict[str, str] | None]:
        span = self.tracer.start(
            name,
            self.root,
            kind="client",
            attributes={"cognitora.endpoint": endpoint, "url.full": url},
        )
        return span, self.tracer.headers(span)

    def finish(self, status: int, usage: tuple[int, int] | None = None, error: str = "") -> None:
        self.root.set_attributes(_outcome(status, usage))
        if error:
            failed(self.root, error)
        self.root.end()

    def _name(self, model: str) -> None:
        self.root.update_name(f"{self.root.name} {model}")

    def _note(self, attributes: Mapping[str, Any]) -> None:
        self.root.set_attributes(attributes)


class _Unsampled(RequestTrace):
    """No spans; the root's attributes kept in case the request fails."""

    def __init__(self, tracer: Tracer, incoming: Incoming, operation: str):
        self.tracer = tracer
        self.incoming = incoming
        self.started_ns = now_ns()
        self.name = operation
        self.attributes: dict[str, Any] = {"gen_ai.operation.name": operation}

    def upstream(self, name: str, endpoint: str, url: str) -> tuple[Any, dict[str, str] | None]:
        return None, self.incoming.headers()  # the engines are told the trace is not sampled

    def finish(self, status: int, usage: tuple[int, int] | None = None, error: str = "") -> None:
        if error:
            attributes = {**self.attributes, **_outcome(status, usage)}
            self.tracer.failed_root(self.name, self.incoming, self.started_ns, attributes, error)

    def _name(self, model: str) -> None:
        self.name = f"{self.name} {model}"

    def _note(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)


def predictions(decision: Decision) -> dict[str, Any]:
    """A time scorer's predictions as route-span attributes: the chosen endpoint's, and the
    `PREDICTED_CANDIDATES` soonest candidates' (endpoints and seconds, soonest first)."""
    soonest = sorted(decision.predicted_s.items(), key=lambda kv: kv[1])[:PREDICTED_CANDIDATES]
    attributes: dict[str, Any] = {
        "cognitora.route.candidates.endpoint": [e for e, _ in soonest],
        "cognitora.route.candidates.predicted_ttft_s": [round(p, 6) for _, p in soonest],
    }
    if decision.predicted_ttft_s is not None:
        attributes["cognitora.route.predicted_ttft_s"] = round(decision.predicted_ttft_s, 6)
    return attributes


def end_upstream(span: Any, outcome: str, error: str = "") -> None:
    """End an upstream span with the attempt's outcome (and its failure, if it failed)."""
    if span is None:
        return
    span.set_attribute("cognitora.outcome", outcome)
    if error:
        failed(span, error)
    span.end()


def decided_by(decision: Decision, weights: Mapping[str, float]) -> str:
    """The scorer whose weighted score put the chosen endpoint furthest ahead of the best
    other candidate ("" when there was no other)."""
    chosen = decision.chosen
    best, lead = "", 0.0
    for scorer, values in decision.scores.items():
        if chosen not in values:
            continue
        others = [v for eid, v in values.items() if eid != chosen]
        if not others:
            continue
        margin = weights.get(scorer, 1.0) * (values[chosen] - max(others))
        if margin > lead:
            best, lead = scorer, margin
    return best
