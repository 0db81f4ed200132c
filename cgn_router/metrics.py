"""cgn-router's Prometheus metrics (one CollectorRegistry per router, no globals), and the
observer that counts every request's records in them (cgn_router/routing/lifecycle.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cgn_router.registry import Registry
from cgn_router.routing.lifecycle import (
    AdapterLoaded,
    AttemptEnded,
    Ended,
    Fallback,
    Hashed,
    Held,
    Migrated,
    PdDecided,
    PdFallback,
    Record,
    Refused,
    Retried,
    Routed,
)
from cgn_router.tally import Tally, TallyCollector, TallyHistogram

if TYPE_CHECKING:
    from cgn_control.loop import ControlState

M = TypeVar("M", Counter, Histogram, Gauge)


class Labelled(Generic[M]):
    """A labelled metric whose children are looked up once (`labels()` is hot: every request)."""

    def __init__(self, metric: M):
        self.metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TENANT_LABELS = 50  # tenants with their own cgn_router_tenant_tokens series, per worker
SCORE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_ERRORS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ERROR_BUCKETS = (*(-e for e in reversed(_ERRORS)), 0.0, *_ERRORS)  # predicted - actual


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Labelled[Counter]:
            return Labelled(Counter(name, doc, labels, registry=r))

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], *labels: str
        ) -> Labelled[Histogram]:
            return Labelled(Histogram(name, doc, labels, buckets=buckets, registry=r))

        def gauge(name: str, doc: str, *labels: str) -> Labelled[Gauge]:
            return Labelled(Gauge(name, doc, labels, registry=r))

        self.admission_wait = histogram(
            "cgn_router_admission_wait_seconds",
            "Time admitted requests waited in the queue.",
            LATENCY_BUCKETS,
            "band",
        )
        self.admission_rejections = counter(
            "cgn_router_admission_rejections",
            "Requests refused by admission or auth, by reason.",
            "band",
            "reason",
        )
        self.adapter_loads = counter(
            "cgn_router_adapter_loads",
            "LoRA adapter loads this router asked engines for, by model and result (loaded, "
            "present: it was already, failed).",
            "model",
            "result",
        )
        self.adapter_load_seconds = histogram(
            "cgn_router_adapter_load_seconds",
            "Time a LoRA adapter load took, asked to answer.",
            LATENCY_BUCKETS,
            "model",
        )
        self.queue_depth = gauge("cgn_router_queue_depth", "Requests waiting, per band.", "band")
        self.saturation = gauge(
            "cgn_router_pool_saturation",
            "max(admitted requests / batch capacity, KV usage) per model pool.",
            "pool",
        )
        # The series every request adds to: Tally, not prometheus_client (see Tally)
        tally, hist = Tally, TallyHistogram
        self.requests = tally(
            "cgn_router_requests", "Requests by model and outcome.", "model", "outcome"
        )
        self.errors = counter(
            "cgn_router_errors", "Failed attempts and requests by cause.", "cause"
        )
        self.retries = counter(
            "cgn_router_retries", "Attempts retried on another endpoint.", "model"
        )
        self.fallbacks = counter(
            "cgn_router_fallbacks", "Requests served by a fallback model.", "model", "served"
        )
        self.migrations = counter(
            "cgn_router_migrations",
            "Streams broken mid-answer, by the engine they came from, cause and what became of "
            "them: continued on another replica, a continuation that failed to start, or not "
            "continued (ended).",
            "model",
            "engine",
            "cause",
            "result",
        )
        self.ttft = hist(
            "cgn_router_ttft_seconds",
            "Request received to first byte relayed.",
            LATENCY_BUCKETS,
            "model",
        )
        self.latency = hist(
            "cgn_router_request_seconds",
            "Request received to response complete.",
            LATENCY_BUCKETS,
            "model",
        )
        self.tokens = tally(
            "cgn_router_tokens", "Tokens by the engines' usage reports.", "model", "kind"
        )
        self.tenant_tokens = tally(
            "cgn_router_tenant_tokens",
            f"Tokens by tenant and kind (prompt, completion, and cached: the prompt tokens its "
            f"own cache served), from the engines' usage reports (the first {TENANT_LABELS} "
            'tenants a worker sees by name, the rest as "other").',
            "tenant",
            "kind",
        )
        self.adapter_tokens = tally(
            "cgn_router_adapter_tokens",
            "Tokens of requests for a LoRA adapter, by model, adapter, tenant (as in "
            "cgn_router_tenant_tokens) and kind (prompt, completion, cached).",
            "model",
            "adapter",
            "tenant",
            "kind",
        )
        self.prefix_predicted = tally(
            "cgn_router_prefix_tokens_predicted",
            "Prompt tokens the router expected the chosen engine to have cached.",
            "model",
        )
        self.prefix_reported = tally(
            "cgn_router_prefix_tokens_reported",
            "Cached prompt tokens the engines reported (usage.prompt_tokens_details).",
            "model",
        )
        self.prompt_tokens_routed = tally(
            "cgn_router_prompt_tokens_routed",
            "Prompt tokens of requests whose usage was reported (the hit ratios' denominator).",
            "model",
        )
        self.hashed = counter(
            "cgn_router_prompts_hashed",
            "Prompts hashed into blocks, by method (chars: approximate, no tokenizer).",
            "model",
            "method",
        )
        self.prompt_cache = counter(
            "cgn_router_prompt_cache_lookups",
            "Prompts looked up in the prefix cache (prompt_cache.py), by model and result: hit "
            "(resumed after a cached prefix) or miss (tokenized and hashed whole).",
            "model",
            "result",
        )
        self.prompt_cache_reused = counter(
            "cgn_router_prompt_cache_tokens_reused",
            "Prompt tokens taken from the prefix cache: neither tokenized nor hashed again.",
            "model",
        )
        self.prompt_cache_bytes = gauge(
            "cgn_router_prompt_cache_bytes",
            "Bytes the prompt prefix cache holds (its budget: routing.prompt_cache_mib per "
            "worker).",
        )
        self.prediction_error = hist(
            "cgn_router_prediction_error_seconds",
            "Predicted minus actual time to first byte of answered attempts (the time scorer), "
            "by engine kind.",
            ERROR_BUCKETS,
            "engine",
        )
        self.scores = hist(
            "cgn_router_scorer_value",
            "Each scorer's value for the chosen endpoint.",
            SCORE_BUCKETS,
            "scorer",
        )
        self.filter_drops = counter(
            "cgn_router_filter_drops", "Endpoints dropped by each filter.", "filter"
        )
        self.saturated = counter(
            "cgn_router_saturation_guard",
            "Cache-warm endpoints denied prefix credit by the saturation guard.",
            "model",
        )
        self.records_ignored = counter(
            "cgn_router_records_ignored",
            "etcd records skipped as invalid (each key and revision once), by kind.",
            "kind",
        )
        self.kv_resyncs = counter(
            "cgn_router_kv_resyncs", "KV event streams (re)started from a snapshot.", "endpoint"
        )
        self.kv_refused = counter(
            "cgn_router_kv_streams_refused",
            "KV event streams refused for another block size or hash namespace.",
            "endpoint",
        )
        self.kv_events = counter("cgn_router_kv_events", "KV events applied.", "endpoint")
        self.pd_decisions = counter(
            "cgn_router_pd_decisions",
            "Requests of models with a prefill pool: split, or why not (routing/disagg.py).",
            "model",
            "reason",
        )
        self.held = histogram(
            "cgn_router_held_seconds",
            "Requests held at the router until a replica could meet their model's TTFT SLO "
            "(hold.py), by how they went: released, expired (sent to the best anyway), gone.",
            LATENCY_BUCKETS,
            "model",
            "result",
        )
        self.pd_fallbacks = counter(
            "cgn_router_pd_fallbacks",
            "Split requests whose decode replica recomputed the prompt, by cause (prefill leg "
            "failures; decode_<reason>: the decode engine could not fetch the KV).",
            "reason",
        )

        r.register(
            TallyCollector(
                [
                    self.requests,
                    self.ttft,
                    self.latency,
                    self.tokens,
                    self.tenant_tokens,
                    self.adapter_tokens,
                    self.prefix_predicted,
                    self.prefix_reported,
                    self.prompt_tokens_routed,
                    self.prediction_error,
                    self.scores,
                ]
            )
        )

    def watch(self, endpoints: Registry) -> None:
        """Export per-endpoint live state at scrape time."""
        self.registry.register(_EndpointCollector(endpoints))

    def watch_budgets(self, rows: Callable[[int], list[tuple[str, str, float]]]) -> None:
        """Export what is left of tenants' budgets: `rows(n)`, the n tenants nearest to
        running out (the ledger's remaining_rows)."""
        self.registry.register(_BudgetCollector(rows))

    def watch_prompts(self, held: Callable[[], float]) -> None:
        """Export the bytes the prompt prefix cache holds, read at scrape time."""
        self.prompt_cache_bytes.metric.set_function(held)

    def watch_scaling(self, control: Callable[[], ControlState | None]) -> None:
        """Export the autoscaler's targets (on the router leading the reconciler)."""
        self.registry.register(_ScalingCollector(control))


class _ModelSeries:
    """The series a model's requests add to, found once per model."""

    __slots__ = (
        "completion",
        "latency",
        "outcomes",
        "predicted",
        "prompt",
        "reported",
        "routed",
        "ttft",
    )

    def __init__(self, m: RouterMetrics, model: str):
        self.latency = m.latency.series(model)
        self.ttft = m.ttft.series(model)
        self.prompt = m.tokens.series(model, "prompt")
        self.completion = m.tokens.series(model, "completion")
        self.predicted = m.prefix_predicted.series(model)
        self.reported = m.prefix_reported.series(model)
        self.routed = m.prompt_tokens_routed.series(model)
        self.outcomes: dict[str, list[float]] = {}  # cgn_router_requests by outcome


class MetricsObserver:
    """Every request's records (routing/lifecycle.py) as the router's metrics. Per request
    it makes one lookup per record kind, one per model and one per scorer; the series it
    adds to are plain numbers (Tally), with no lock or check."""

    def __init__(self, metrics: RouterMetrics):
        self.m = m = metrics
        self._models: dict[str, _ModelSeries] = {}
        # tenant -> (prompt, completion, cached prompt tokens)
        self._tenants: dict[str, tuple[list[float], list[float], list[float]]] = {}
        self._adapters: dict[
            tuple[str, str, str], tuple[list[float], list[float], list[float]]
        ] = {}
        self._on: dict[type, Callable[[Any], None]] = {
            AttemptEnded: self._attempt,
            Ended: self._ended,
            Routed: self._routed,
            Refused: lambda r: m.admission_rejections.labels(r.band, r.reason).inc(),
            Hashed: self._hashed,
            Retried: lambda r: m.retries.labels(r.model).inc(),
            Fallback: lambda r: m.fallbacks.labels(r.model, r.served).inc(),
            Migrated: lambda r: m.migrations.labels(r.model, r.engine, r.cause, r.result).inc(),
            PdDecided: lambda r: m.pd_decisions.labels(r.model, r.reason).inc(),
            PdFallback: lambda r: m.pd_fallbacks.labels(r.reason).inc(),
            Held: lambda r: m.held.labels(r.model, r.result).observe(r.held_s),
            AdapterLoaded: self._adapter_loaded,
        }

    def _hashed(self, r: Hashed) -> None:
        m = self.m
        m.hashed.labels(r.model, r.method).inc()
        if r.reused is not None:  # looked up in the prefix cache
            m.prompt_cache.labels(r.model, "hit" if r.reused else "miss").inc()
            if r.reused:
                m.prompt_cache_reused.labels(r.model).inc(r.reused)

    def _adapter_loaded(self, r: AdapterLoaded) -> None:
        self.m.adapter_loads.labels(r.model, r.result).inc()
        self.m.adapter_load_seconds.labels(r.model).observe(r.seconds)

    def observe(self, record: Record) -> None:
        handler = self._on.get(type(record))
        if handler is not None:
            handler(record)

    def _tenant(self, tenant: str) -> tuple[list[float], list[float], list[float]]:
        """A tenant's three series (prompt, completion, cached prompt tokens: its own hit
        rate, its cache being its own, #58); past TENANT_LABELS tenants, the shared "other"
        ones (a label per tenant would let keys grow the scrape without bound)."""
        found = self._tenants.get(tenant)
        if found is None:
            label = tenant if len(self._tenants) < TENANT_LABELS else "other"
            tally = self.m.tenant_tokens
            found = (tally.series(label, "prompt"), tally.series(label, "completion"),
                     tally.series(label, "cached"))  # fmt: skip
            if label != "other":
                self._tenants[tenant] = found
        return found

    def _adapter(
        self, model: str, adapter: str, tenant: str
    ) -> tuple[list[float], list[float], list[float]]:
        """A tenant's three series for one adapter (the catalog's names only reach here:
        bounded by it; tenants past TENANT_LABELS as "other", as `_tenant`)."""
        label = tenant if tenant in self._tenants else "other"
        key = (model, adapter, label)
        found = self._adapters.get(key)
        if found is None:
            tally = self.m.adapter_tokens
            found = self._adapters[key] = (
                tally.series(model, adapter, label, "prompt"),
                tally.series(model, adapter, label, "completion"),
                tally.series(model, adapter, label, "cached"),
            )
        return found

    def _model(self, model: str) -> _ModelSeries:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = _ModelSeries(self.m, model)
        return found

    def _ended(self, r: Ended) -> None:
        if not r.outcome:  # routing was not tried: counted by its refusal, not as a request
            return
        series = self._model(r.model)
        count = series.outcomes.get(r.outcome)
        if count is None:
            count = series.outcomes[r.outcome] = self.m.requests.series(r.model, r.outcome)
        count[0] += 1
        series.latency.observe(r.seconds)
        if r.usage is not None and r.tenant:
            for prompt, completion, cached in (self._tenant(r.tenant),) + (
                (self._adapter(r.model, r.adapter, r.tenant),) if r.adapter else ()
            ):
                prompt[0] += r.usage.prompt_tokens
                completion[0] += r.usage.completion_tokens
                cached[0] += r.usage.cached_tokens
        if r.outcome == "no_endpoint":
            self.m.errors.labels("no_endpoint").inc()

    def _attempt(self, r: AttemptEnded) -> None:
        """A failed attempt counts its cause; one that answered, its TTFT (when it sent the
        client's first byte), a broken stream's cause, and the engine's usage (its request
        counts once it ends: Ended)."""
        if r.leg != "client":  # a prefill leg's failure is its PdFallback
            return
        if r.outcome in ("failed", "busy"):
            self.m.errors.labels(r.cause).inc()
            return
        series = self._model(r.model)
        if r.first_byte_s is not None:
            series.ttft.observe(r.first_byte_s)
        if r.predicted_ttft_s is not None and r.sample is not None:
            self.m.prediction_error.series(r.engine).observe(r.predicted_ttft_s - r.sample.ttft_s)
        if r.cause:
            self.m.errors.labels(r.cause).inc()
        if r.broken or (u := r.usage) is None:
            return
        series.prompt[0] += u.prompt_tokens
        series.routed[0] += u.prompt_tokens  # the hit ratios' denominator
        series.completion[0] += u.completion_tokens
        series.predicted[0] += r.predicted
        series.reported[0] += u.cached_tokens

    def _routed(self, r: Routed) -> None:
        m, decision = self.m, r.decision
        for name, n in decision.dropped.items():
            m.filter_drops.labels(name).inc(n)
        if decision.chosen is not None:
            for scorer, values in decision.scores.items():
                m.scores.series(scorer).observe(values[decision.chosen])
            if decision.saturated:
                m.saturated.labels(r.model).inc(decision.saturated)


class _EndpointCollector(Collector):
    def __init__(self, endpoints: Registry):
        self.endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        labels = ["endpoint", "model"]
        fams = {
            "in_flight": GaugeMetricFamily(
                "cgn_router_endpoint_in_flight", "Requests in flight.", labels=labels
            ),
            "pending": GaugeMetricFamily(
                "cgn_router_endpoint_pending_prefill_tokens",
                "Uncached prompt tokens routed and not yet answered.",
                labels=labels,
            ),
            "breaker": GaugeMetricFamily(
                "cgn_router_endpoint_breaker_open",
                "1 while the circuit breaker blocks traffic.",
                labels=labels,
            ),
            "stale": GaugeMetricFamily(
                "cgn_router_endpoint_metrics_stale",
                "1 when the engine's load figures are missing or stale.",
                labels=labels,
            ),
            "blocks": GaugeMetricFamily(
                "cgn_router_endpoint_kv_blocks",
                "KV blocks known on the endpoint, by tracking kind.",
                labels=[*labels, "tracking"],
            ),
            # the speed the `time` scorer predicts with (routing/speed.py, #57)
            "prefill": GaugeMetricFamily(
                "cgn_router_endpoint_prefill_seconds_per_token",
                "Learned seconds per uncached prompt token (its model's typical, or the "
                "prior, until it has answered enough: cgn_router_endpoint_speed_learned).",
                labels=labels,
            ),
            "decode": GaugeMetricFamily(
                "cgn_router_endpoint_decode_seconds_per_token",
                "Learned seconds per output token of one stream alone.",
                labels=labels,
            ),
            "learned": GaugeMetricFamily(
                "cgn_router_endpoint_speed_learned",
                "1 once the endpoint's speed is learned from its own answers.",
                labels=labels,
            ),
        }
        for eid, s in self.endpoints.states.items():
            lv = [eid, s.endpoint.model]
            speed = self.endpoints.speed(s, now)
            fams["prefill"].add_metric(lv, speed.prefill_s)
            fams["decode"].add_metric(lv, speed.decode_s)
            fams["learned"].add_metric(lv, 1.0 if speed.warm else 0.0)
            fams["in_flight"].add_metric(lv, s.in_flight)
            fams["pending"].add_metric(lv, s.pending_prefill)
            fams["breaker"].add_metric(lv, 1.0 if s.breaker.blocks(now) else 0.0)
            fams["stale"].add_metric(lv, 1.0 if self.endpoints.fresh_load(s, now) is None else 0.0)
            fams["blocks"].add_metric([*lv, "exact"], self.endpoints.index.exact_size(eid))
            fams["blocks"].add_metric([*lv, "assumed"], self.endpoints.index.assumed_size(eid))
        yield from fams.values()


class _BudgetCollector(Collector):
    def __init__(self, rows: Callable[[int], list[tuple[str, str, float]]]):
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        left = GaugeMetricFamily(
            "cgn_router_tenant_budget_remaining",
            f"What is left of each tenant's budget in its period (tokens or joules), over "
            f"every router; the {TENANT_LABELS} tenants nearest to running out.",
            labels=["tenant", "budget"],
        )
        for tenant, budget, value in self.rows(TENANT_LABELS):
            left.add_metric([tenant, budget], value)
        yield left


class _ScalingCollector(Collector):
    def __init__(self, control: Callable[[], ControlState | None]):
        self.control = control

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        desired = GaugeMetricFamily(
            "cgn_autoscaler_desired_replicas",
            "The autoscaler's target per pool (on the leading router only).",
            labels=["pool"],
        )
        current = GaugeMetricFamily(
            "cgn_autoscaler_current_replicas",
            "Replicas placed and not draining per pool, as the autoscaler counted them.",
            labels=["pool"],
        )
        changes = CounterMetricFamily(
            "cgn_autoscaler_decisions",
            "Target changes since this router began leading, by pool and direction.",
            labels=["pool", "direction"],
        )
        state = self.control()
        if state is not None and state.leading:
            for pool, d in state.scaling.items():
                desired.add_metric([pool], d["desired"])
                current.add_metric([pool], d["current"])
            for (pool, direction), n in state.changes.items():
                changes.add_metric([pool, direction], n)
        yield from (desired, current, changes)
