"""cgn-infer's Prometheus metrics, under vLLM's names so routers read it like vLLM.

vLLM names (docs/architecture.md, engine contract): requests running/waiting, KV-cache usage,
prompt and generation token counters, prefix-cache queries and hits (in
tokens, as vLLM v1 counts them), preemptions, TTFT, inter-token latency and
end-to-end latency histograms, finished requests by reason. Cognitora's own
additions start with `cgn_infer_`. One registry per engine (no globals).
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cgn_infer.stats import JobStats, QueueStats, Stats

_LATENCY = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class PerAdapter:
    """A gauge with one series per loaded adapter (the set is bounded by `max_loras`)."""

    def __init__(self, gauge: Gauge, model: str):
        self.gauge, self.model = gauge, model

    def set(self, adapter: str) -> None:
        self.gauge.labels(self.model, adapter).set(1)

    def remove(self, adapter: str) -> None:
        with contextlib.suppress(KeyError):  # never set
            self.gauge.remove(self.model, adapter)


class EngineMetrics:
    """One engine's metrics, each already bound to its `model_name` label."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model)

        self.running = gauge("vllm:num_requests_running", "Requests being generated.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued, not yet started.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens.", _LATENCY)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency.", _E2E)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted for KV blocks.")
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self._model = model
        self.load_seconds = gauge("cgn_infer_model_load_seconds", "Time to load the weights.")
        doc = "1 for each LoRA adapter loaded (its slot held)."
        loaded = Gauge("cgn_infer_lora_loaded", doc, [*labels, "adapter"], registry=r)
        self.lora_loaded = PerAdapter(loaded, model)
        self.lora_slots = gauge(
            "cgn_infer_lora_slots", "LoRA adapters it holds at most (max_loras)."
        )
        self.lora_load_seconds = hist(
            "cgn_infer_lora_load_seconds", "Time to load a LoRA adapter at run time.",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )  # fmt: skip
        self.lora_evictions = counter(
            "cgn_infer_lora_evictions", "LoRA adapters evicted to load another."
        )
        self.step_sequences = hist(
            "cgn_infer_step_sequences", "Sequences run in one model step.", (1, 2, 4, 8, 16, 32, 64)
        )
        self.kv_pool_bytes = gauge("cgn_infer_kv_pool_bytes", "KV pool memory (sim: hash slots).")
        self.kv_pool_tokens = gauge("cgn_infer_kv_pool_tokens", "KV pool capacity in tokens.")
        self.rejected = counter("cgn_infer_requests_rejected", "Requests refused with a 4xx.")
        self.prefill_computed = counter(
            "cgn_infer_prefill_tokens_computed", "Prompt tokens run through the model (not reused)."
        )
        # cgn-kvcached (the node's KV store): restores and offers
        self._restored = Counter(
            "cgn_infer_kv_restored_tokens",
            "Prompt tokens restored from cgn-kvcached, by tier.",
            [*labels, "tier"],
            registry=r,
        )
        self.kv_restore_seconds = hist(
            "cgn_infer_kv_restore_seconds",
            "Time to fetch a prompt's blocks from cgn-kvcached.",
            _LATENCY,
        )
        self.kv_restore_skipped = counter(
            "cgn_infer_kv_restore_skipped", "Restores the cost model judged slower than recompute."
        )
        self.kv_restore_failures = counter(
            "cgn_infer_kv_restore_failures", "Restores that failed or timed out (recomputed)."
        )
        self.kv_offloaded_blocks = counter(
            "cgn_infer_kv_offloaded_blocks", "Blocks offered to and stored by cgn-kvcached."
        )
        self.kv_offload_dropped = counter(
            "cgn_infer_kv_offload_dropped", "Blocks not offered (queue full, kvcached down)."
        )

        # structured outputs (grammar.py)
        self.constrained = counter(
            "cgn_infer_constrained_requests", "Requests generated under a grammar (formats, tools)."
        )
        self.grammar_compile_seconds = hist(
            "cgn_infer_grammar_compile_seconds",
            "Time to compile a grammar not in the cache.",
            _LATENCY,
        )

        # prefill/decode disaggregation (transfer.py)
        self.kv_transfer_held = counter(
            "cgn_infer_kv_transfer_held_blocks", "Blocks held for decode engines (prefill legs)."
        )
        self.kv_transfer_holding = gauge(
            "cgn_infer_kv_transfer_holding_blocks",
            "Blocks held now for decode engines, until their leases end (prefill legs).",
        )
        self.kv_transfer_blocks = counter(
            "cgn_infer_kv_transfer_fetched_blocks", "Blocks fetched from prefill engines."
        )
        self.kv_transfer_seconds = hist(
            "cgn_infer_kv_transfer_seconds", "Time to fetch a decode leg's blocks.", _LATENCY
        )
        self._pd_fallbacks = Counter(
            "cgn_infer_pd_fallbacks",
            "Decode legs that recomputed what the transfer lacked.",
            [*labels, "reason"],
            registry=r,
        )

    def observe(self, stats: Stats) -> None:
        """The engine's stats of a step or a turn (cgn_infer/stats.py)."""
        if isinstance(stats, QueueStats):
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
            self.kv_usage.set(stats.kv_usage)
            return
        if stats.preempted:
            self.preemptions.inc(stats.preempted)
        if not stats.sequences:
            return
        self.step_sequences.observe(stats.sequences)
        self.prefill_computed.inc(stats.prefill_computed)
        for prompt in stats.prompts:
            self.prompt_tokens.inc(prompt.tokens)
            self.prefix_queries.inc(prompt.tokens)
            self.prefix_hits.inc(prompt.hits)
            for tier, n in prompt.restored:
                self._restored.labels(self._model, tier).inc(n)
        for seconds in stats.first_tokens:
            self.ttft.observe(seconds)
        for seconds in stats.gaps:
            self.itl.observe(seconds)
        self.generation_tokens.inc(len(stats.first_tokens) + len(stats.gaps))

    def finished(self, job: JobStats) -> None:
        """A job's end (its FinishEvent's stats)."""
        self.e2e.observe(job.finished - job.enqueued)
        reason = "abort" if job.reason == "cancelled" else job.reason
        self._success.labels(self._model, reason).inc()

    def pd_fallback(self, reason: str) -> None:
        self._pd_fallbacks.labels(self._model, reason).inc()
