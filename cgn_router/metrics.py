"""cgn-router's Prometheus metrics (one CollectorRegistry per router, no globals)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cgn_router.registry import Registry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SCORE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "cgn_router_requests",
            "Requests by model and outcome.",
            ["model", "outcome"],
            registry=r,
        )
        self.errors = Counter(
            "cgn_router_errors", "Failed attempts and requests by cause.", ["cause"], registry=r
        )
        self.retries = Counter(
            "cgn_router_retries", "Attempts retried on another endpoint.", ["model"], registry=r
        )
        self.fallbacks = Counter(
            "cgn_router_fallbacks",
            "Requests served by a fallback model.",
            ["model", "served"],
            registry=r,
        )
        self.ttft = Histogram(
            "cgn_router_ttft_seconds",
            "Request received to first byte relayed.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "cgn_router_request_seconds",
            "Request received to response complete.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "cgn_router_tokens",
            "Tokens by the engines' usage reports.",
            ["model", "kind"],
            registry=r,
        )
        self.prefix_predicted = Counter(
            "cgn_router_prefix_tokens_predicted",
            "Prompt tokens the router expected the chosen engine to have cached.",
            ["model"],
            registry=r,
        )
        self.prefix_reported = Counter(
            "cgn_router_prefix_tokens_reported",
            "Cached prompt tokens the engines reported (usage.prompt_tokens_details).",
            ["model"],
            registry=r,
        )
        self.prompt_tokens_routed = Counter(
            "cgn_router_prompt_tokens_routed",
            "Prompt tokens of requests whose usage was reported (the hit ratios' denominator).",
            ["model"],
            registry=r,
        )
        self.hashed = Counter(
            "cgn_router_prompts_hashed",
            "Prompts hashed into blocks, by method (chars: approximate, no tokenizer).",
            ["model", "method"],
            registry=r,
        )
        self.scores = Histogram(
            "cgn_router_scorer_value",
            "Each scorer's value for the chosen endpoint.",
            ["scorer"],
            buckets=SCORE_BUCKETS,
            registry=r,
        )
        self.filter_drops = Counter(
            "cgn_router_filter_drops", "Endpoints dropped by each filter.", ["filter"], registry=r
        )
        self.saturated = Counter(
            "cgn_router_saturation_guard",
            "Cache-warm endpoints denied prefix credit by the saturation guard.",
            ["model"],
            registry=r,
        )
        self.kv_resyncs = Counter(
            "cgn_router_kv_resyncs",
            "KV event streams (re)started from a snapshot.",
            ["endpoint"],
            registry=r,
        )
        self.kv_events = Counter(
            "cgn_router_kv_events", "KV events applied.", ["endpoint"], registry=r
        )

    def watch(self, endpoints: Registry) -> None:
        """Export per-endpoint live state at scrape time."""
        self.registry.register(_EndpointCollector(endpoints))


class _EndpointCollector(Collector):
    def __init__(self, endpoints: Registry):
        self.endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import time

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
        }
        for eid, s in self.endpoints.states.items():
            lv = [eid, s.endpoint.model]
            fams["in_flight"].add_metric(lv, s.in_flight)
            fams["pending"].add_metric(lv, s.pending_prefill)
            fams["breaker"].add_metric(lv, 1.0 if s.breaker.blocks(now) else 0.0)
            fams["stale"].add_metric(lv, 1.0 if self.endpoints.fresh_load(s, now) is None else 0.0)
            fams["blocks"].add_metric([*lv, "exact"], self.endpoints.index.exact_size(eid))
            fams["blocks"].add_metric([*lv, "assumed"], self.endpoints.index.assumed_size(eid))
        yield from fams.values()
