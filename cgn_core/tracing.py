"""OpenTelemetry traces for the request path: off by default, on by one setting per service.

    tracing:
      enabled: true
      endpoint: http://collector:4317   # OTLP/gRPC (Jaeger, Tempo, an OTel collector)
      sample_ratio: 0.01                # of the traces that start here or come in sampled

A service holds a `Tracer` when tracing is on and None when it is off, so the
request path does nothing for traces but one `is None` test (the SDK is not
even imported). With it on:

* Sampling: a trace that comes in with a `traceparent` keeps the caller's
  decision; one that starts here is sampled with `sample_ratio`. An
  unsampled request makes no spans at all (it carries an unsampled
  `traceparent` on, so the engines decide alike); if it fails, its root span
  alone is made when it ends, with its real start, and exported under the
  same trace id: errors are always seen, their children only when sampled.
  (Recording every span of every request to keep the failed ones whole cost
  1.5-1.9x the router's CPU per request at 1 %: measured, and not done.)
* Export: one thread sends batches to the collector (OTLP/gRPC, the
  opentelemetry-exporter-otlp-proto-grpc package); the queue between the
  request path and it holds `queue_spans` spans, and a span that finds it
  full is dropped and counted (`SpanCounts` on /metrics), so a slow or unreachable
  collector costs the requests nothing but those spans.
* Propagation: W3C trace context (`traceparent`, `tracestate`) in and out.

The SDK and exporter are the `tracing` extra (`pip install
'cognitora-cluster[tracing]'`); turning tracing on without them is a
ConfigError that says so.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.registry import Collector

from cgn_core.errors import ConfigError
from cgn_core.settings import TracingSettings


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request's trace as it arrives: sampled (continuing `context`, None for a new trace),
    or not (its ids, passed on unsampled; no OpenTelemetry objects are made for it)."""

    sampled: bool
    context: Any = None
    trace_id: int = 0
    span_id: int = 0
    tracestate: str = ""

    def headers(self) -> dict[str, str]:
        """An unsampled request's `traceparent` (and `tracestate`), for the calls it makes."""
        out = {"traceparent": f"00-{self.trace_id:032x}-{self.span_id:016x}-00"}
        if self.tracestate:
            out["tracestate"] = self.tracestate
        return out


class Tracer:
    """Spans for one service (its name on every span's resource)."""

    def __init__(self, settings: TracingSettings, service: str, instance: str = ""):
        try:
            from opentelemetry.propagators.textmap import DefaultGetter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider, sampling
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise ConfigError(
                "tracing.enabled needs the OpenTelemetry SDK: "
                "pip install 'cognitora-cluster[tracing]'"
            ) from None
        # NOTE: the decision is made in `incoming`; the SDK follows the parent it is given
        sampler = sampling.ParentBased(root=sampling.ALWAYS_ON)
        attributes = {"service.name": service}
        if instance:
            attributes["service.instance.id"] = instance
        self.provider = TracerProvider(
            sampler=sampler, resource=Resource.create(attributes), shutdown_on_exit=False
        )
        from cgn_core.trace_export import Exporting

        self.exporting = Exporting(settings)
        self.provider.add_span_processor(self.exporting)
        self.tracer = self.provider.get_tracer("cognitora")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()
        from opentelemetry import context, trace

        self._trace = trace
        self._context_type = context.Context
        self._kinds = {k.name.lower(): k for k in trace.SpanKind}
        self.ratio = settings.sample_ratio
        self._rng = random.Random()

    def incoming(self, headers: Mapping[str, str]) -> Incoming:
        """What a request continues: its `traceparent` and the caller's decision; without
        one, a new trace sampled with `sample_ratio` (an unsampled new trace still gets ids,
        so that its failure and the engines' join one trace)."""
        if "traceparent" not in headers:  # NOTE: the common case costs one random number
            if self._rng.random() < self.ratio:
                return Incoming(True)
            ids = self._rng.getrandbits(128) or 1, self._rng.getrandbits(64) or 1
            return Incoming(False, None, *ids)
        ctx = self._propagator.extract(headers, getter=self._getter)
        parent = self._trace.get_current_span(ctx).get_span_context()
        if not parent.is_valid:  # a malformed header: a trace of our own
            return self.incoming({})
        if parent.trace_flags.sampled:
            return Incoming(True, ctx)
        state = bounded_tracestate(headers.get("tracestate") or "")
        return Incoming(False, None, parent.trace_id, parent.span_id, state)

    def failed_root(
        self,
        name: str,
        incoming: Incoming,
        start_ns: int,
        attributes: Mapping[str, Any],
        error: str,
    ) -> None:
        """The root span of an unsampled request that failed, made as it ends, sampled."""
        parent = self._trace.SpanContext(
            incoming.trace_id,
            incoming.span_id,
            is_remote=True,
            trace_flags=self._trace.TraceFlags(self._trace.TraceFlags.SAMPLED),
        )
        span = self.start(
            name,
            self._trace.set_span_in_context(self._trace.NonRecordingSpan(parent)),
            kind="server",
            attributes=attributes,
            start_ns=start_ns,
        )
        failed(span, error)
        span.end()

    def start(
        self,
        name: str,
        parent: Any = None,
        *,
        kind: str = "internal",
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> Any:
        """A started span under `parent` (a span, or a context from `incoming`; None: a new
        trace). `kind`: internal, server or client."""
        if parent is not None and not isinstance(parent, self._context_type):  # a span
            parent = self._trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name,
            context=parent,
            kind=self._kinds[kind],
            attributes=attributes,
            start_time=start_ns,
        )

    def headers(self, span: Any) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span`, for the request it makes."""
        out: dict[str, str] = {}
        self._propagator.inject(out, context=self._trace.set_span_in_context(span))
        return out

    def close(self) -> None:
        """Send what is queued (bounded by the export timeout) and stop the export thread."""
        self.provider.shutdown()


class SpanCounts(Collector):
    """`<prefix>_trace_spans_exported_total` and `..._dropped_total` for a service's /metrics."""

    def __init__(self, tracer: Tracer, prefix: str):
        self.tracer = tracer
        self.prefix = prefix

    def collect(self) -> Iterator[CounterMetricFamily]:
        exporting = self.tracer.exporting
        yield CounterMetricFamily(
            f"{self.prefix}_trace_spans_exported",
            "Spans the collector accepted.",
            value=exporting.exported,
        )
        yield CounterMetricFamily(
            f"{self.prefix}_trace_spans_dropped",
            "Spans dropped: the export queue was full or the collector failed a batch.",
            value=exporting.dropped,
        )


def failed(span: Any, error_type: str, message: str = "") -> None:
    """Mark `span` as an error (`error.type`, and the status the collector shows)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message or error_type))


def now_ns() -> int:
    return time.time_ns()


TRACESTATE_MEMBERS = 32  # W3C trace context: a tracestate holds at most this many
TRACESTATE_CHARS = 512  # and a propagator keeps at least this many characters of it
_VALUE_CHAR = r"\x2d-\x3c\x3e-\x7e\x21-\x2b"  # printable, but not ',' or '=' (nor space)
# NOTE: anchored (it is only ever matched whole): a search cannot restart it at every position
_MEMBER = re.compile(
    rf"\A[a-z0-9][a-z0-9_\-*/@]{{0,255}}=[ {_VALUE_CHAR}]{{0,255}}[{_VALUE_CHAR}]\Z"
)


def bounded_tracestate(value: str) -> str:
    """A client's `tracestate`, as forwarded: its well-formed members, in order, at most 32 of
    them and 512 characters (a client's 8 KB of it reached an engine, which refused the
    request with its parser's text); what is dropped is what the spec lets a hop drop."""
    kept: list[str] = []
    size = 0
    for raw in value.split(",", TRACESTATE_MEMBERS * 4)[: TRACESTATE_MEMBERS * 4]:
        member = raw.strip(" \t")
        if not member or not _MEMBER.fullmatch(member):
            continue
        if len(kept) == TRACESTATE_MEMBERS or size + len(member) + len(kept) > TRACESTATE_CHARS:
            break
        kept.append(member)
        size += len(member)
    return ",".join(kept)
