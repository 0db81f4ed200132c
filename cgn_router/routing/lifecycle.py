"""One account of each request: the records the request path emits, and who observes them.

The request path (server.py) counts nothing itself. At each point of a
request's life it emits one frozen record to the request's `Account`, which
hands it to every observer in turn (llm-d's plugin points, vLLM's stats
loggers):

    Asked ─ Hashed ─ Admitted ─┬─ Routed ─ AttemptStarted ─ AttemptEnded ─┐  per attempt
                               │  Retried · Fallback · Migrated · Unrouted │
                               │  PdDecided · PdFallback · Held            │
    Refused (a key's limit)    └─────────────────── Ended (exactly once) ──┘

Observers, built in daemon.py and handed to the service: the Prometheus
metrics (`metrics.MetricsObserver`), the autoscaler's load signals
(`load_signals.LoadObserver`), each request's trace (`trace.RequestTrace`),
and in tests a `RecordList`. An observer's answer to `AttemptStarted` is
headers for the upstream request (a trace's `traceparent`); to anything else,
None. Records hold values, not live objects (`Routed.decision` is the chain's
frozen decision). They are NamedTuples rather than frozen dataclasses: as
immutable, and a third of the cost to make (0.3-0.5 us against 1.6 us each,
eight or more a request).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from cgn_router.routing.chain import Decision
    from cgn_router.routing.speed import Sample
    from cgn_router.types import Usage


class Asked(NamedTuple):
    """The body is read: the model name it asks for, and who asks (never the key itself)."""

    asked: str
    tenant: str
    band: str
    key_id: str


class Refused(NamedTuple):
    """A key's limit refused the request before it was routed."""

    band: str
    reason: str  # rate_limited


class Hashed(NamedTuple):
    model: str
    method: str  # token_ids | tokenizer | chars
    reused: int | None = None  # tokens from the prompt prefix cache (None: not looked up)


class Admitted(NamedTuple):
    waited_s: float  # in admission's queue


class Routed(NamedTuple):
    """The chain's decision for a replica of `model` in `role`; it took `took_ns` to make."""

    model: str
    role: str
    decision: Decision
    weights: Mapping[str, float]
    took_ns: int


class AttemptStarted(NamedTuple):
    attempt: int  # 1, 2, ... within the request
    name: str  # upstream | upstream (continuation) | prefill leg
    endpoint: str
    url: str


class AttemptEnded(NamedTuple):
    """An attempt's end. `first_byte_s`: from the request's start to the client's first
    byte, when this attempt sent it. `cause`: why it failed (AttemptFailed), or why its
    stream broke after the first byte; `broken`: a stream left open for migration."""

    attempt: int
    model: str
    leg: str  # client (the answer) | prefill
    outcome: str  # registry.Outcome
    cause: str = ""
    first_byte_s: float | None = None
    usage: Usage | None = None
    predicted: int = 0  # cached prompt tokens the router expected on this endpoint
    broken: bool = False
    endpoint: str = ""  # its id
    engine: str = ""  # its engine kind (vllm, cgn-infer, ...): the prediction error's class
    predicted_ttft_s: float | None = None  # its start to its first byte, as the chain predicted
    sample: Sample | None = None  # an answered attempt's observation of the endpoint's speed


class Retried(NamedTuple):
    model: str


class Fallback(NamedTuple):
    model: str
    served: str


class Migrated(NamedTuple):
    model: str
    cause: str
    result: str  # continued | failed | not_continued
    engine: str = ""  # the engine the broken stream came from (cgn-infer, llamacpp, ...)


class Unrouted(NamedTuple):
    """Demand for a model with no replica (a pool at min 0): the autoscaler counts it."""

    model: str


class Held(NamedTuple):
    """The request waited at the router for a replica to meet its TTFT SLO (hold.py)."""

    model: str
    held_s: float
    result: str  # released | expired | gone


class AdapterLoaded(NamedTuple):
    """The router asked a replica to load a LoRA adapter (cgn_router/adapters.py): for a
    request that waits on it, or in the background for a hot adapter."""

    model: str
    endpoint: str
    result: str  # loaded | present (it was already) | failed
    seconds: float


class PdDecided(NamedTuple):
    model: str
    reason: str


class PdFallback(NamedTuple):
    reason: str


class Ended(NamedTuple):
    """The request's end, as the client saw it. `outcome`: for a request routing was tried
    for (ok, client_error, client_disconnected, upstream_error, no_endpoint), else ""."""

    model: str
    outcome: str
    status: int
    seconds: float
    usage: Usage | None = None
    error: str = ""
    tenant: str = ""  # its key's (once authenticated)
    endpoint: str = ""  # the id of the endpoint whose attempt answered ("": none did)
    key_id: str = ""  # its API key's id (once authenticated; "": auth off)
    adapter: str = ""  # the LoRA adapter it named ("": the model itself)


Record = (
    Asked
    | Held
    | AdapterLoaded
    | Refused
    | Hashed
    | Admitted
    | Routed
    | AttemptStarted
    | AttemptEnded
    | Retried
    | Fallback
    | Migrated
    | Unrouted
    | PdDecided
    | PdFallback
    | Ended
)


class Observer(Protocol):
    def observe(self, record: Record) -> Mapping[str, str] | None:
        """Take one record; for an `AttemptStarted`, what to add to the upstream request's
        headers (None: nothing)."""
        ...


class Account:
    """One request's records, handed to its observers as they happen. Besides the records it
    holds what `Ended` needs: the model (the one the request means, once known; then the one
    whose attempt answered, a fallback too), the outcome (the last answering attempt's;
    or, when routing gave up, why: no_endpoint, upstream_error) and that attempt's endpoint."""

    __slots__ = (
        "adapter",
        "attempts",
        "endpoint",
        "key_id",
        "model",
        "observers",
        "outcome",
        "started",
        "tenant",
    )

    def __init__(self, observers: Sequence[Observer], started: float | None = None):
        self.observers = observers
        self.started = time.monotonic() if started is None else started
        self.model = ""
        self.adapter = ""  # the LoRA adapter the request names, once known
        self.tenant = ""  # once Asked: the key's
        self.key_id = ""
        self.outcome = ""
        self.endpoint = ""  # the answering attempt's
        self.attempts = 0

    def emit(self, record: Record) -> None:
        if isinstance(record, Asked):
            self.tenant, self.key_id = record.tenant, record.key_id
        elif (
            isinstance(record, AttemptEnded)
            and record.leg == "client"
            and record.outcome not in ("failed", "busy")  # it answered the client
        ):
            self.model, self.outcome, self.endpoint = record.model, record.outcome, record.endpoint
        for observer in self.observers:
            observer.observe(record)

    def attempt(self, name: str, endpoint: str, url: str) -> tuple[int, dict[str, str]]:
        """Start an attempt: its number, and the headers the observers add upstream."""
        self.attempts += 1
        started = AttemptStarted(self.attempts, name, endpoint, url)
        headers: dict[str, str] = {}
        for observer in self.observers:
            if extra := observer.observe(started):
                headers.update(extra)
        return self.attempts, headers


class RecordList:
    """An observer that keeps every record, in order (tests assert scenarios with it)."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def observe(self, record: Record) -> None:
        self.records.append(record)

    def kinds(self) -> list[str]:
        return [type(r).__name__ for r in self.records]
