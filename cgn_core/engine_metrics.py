"""Engines' Prometheus vocabularies, read under vLLM's meaning (docs/architecture.md).

Each engine family names the same signals differently; `NAME_MAPS` maps the
router's engine names (the `engine` field of an endpoint record) onto them.
A signal is the sum over all label sets of the first of its candidate names
present (engines with several ranks or models report one series each). The
router scores endpoints with these figures; the agent reads requests in
flight with them before it stops a draining engine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cgn_core.keys import NAME


@dataclass(frozen=True, slots=True)
class NameMap:
    """Per signal, the engine's candidate names (the first present is read); () where the
    engine publishes no such figure: readers show none ("—"), never a 0."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]  # a fraction 0..1
    prompt_tokens: tuple[str, ...] = ()  # counters
    generation_tokens: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()  # prompt tokens served from the prefix cache
    prefix_queries: tuple[str, ...] = ()  # prompt tokens looked up
    requests_done: tuple[str, ...] = ()
    ttft: tuple[str, ...] = ()  # histograms (base names)
    itl: tuple[str, ...] = ()
    # the prompt counter leaves out tokens served from the cache (counted as prefix_hits):
    # prompt tokens are the two together, and so are the prefix lookups
    prompt_excludes_cached: bool = False


VLLM = NameMap(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # v1, then v0
    prompt_tokens=("vllm:prompt_tokens_total",),
    generation_tokens=("vllm:generation_tokens_total",),
    prefix_hits=("vllm:prefix_cache_hits_total",),
    prefix_queries=("vllm:prefix_cache_queries_total",),
    requests_done=("vllm:request_success_total",),
    ttft=("vllm:time_to_first_token_seconds",),
    itl=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
)
NAME_MAPS: dict[str, NameMap] = {
    "cgn-infer": VLLM,
    "vllm": VLLM,
    # SGLang with --enable-metrics (docs.sglang.io, "Production Metrics")
    "sglang": NameMap(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        prompt_tokens=("sglang:prompt_tokens_total",),
        generation_tokens=("sglang:generation_tokens_total",),
        requests_done=("sglang:num_requests_total",),
        ttft=("sglang:time_to_first_token_seconds",),
        itl=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    ),
    # llama-server with --metrics (a page recorded from xllamacpp's build is in
    # tests/fixtures/metrics_llamacpp.txt): no KV-usage gauge in current builds, no
    # latency histograms, no request count; its prompt counter leaves out cached tokens,
    # which it counts apart
    "llamacpp": NameMap(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        prompt_tokens=("llamacpp:prompt_tokens_total",),
        generation_tokens=("llamacpp:tokens_predicted_total",),
        prefix_hits=("llamacpp:prompt_tokens_cached_total",),
        prompt_excludes_cached=True,
    ),
    # mlx_lm.server has no /metrics; cgn-agent's runner (cgn_agent/launchers/mlx_lm_server.py)
    # counts around it: no queue figure, no KV usage, no latency histograms
    "mlx_lm": NameMap(
        running=("mlx_lm:requests_running",),
        waiting=(),
        kv_usage=(),
        prompt_tokens=("mlx_lm:prompt_tokens_total",),
        generation_tokens=("mlx_lm:generation_tokens_total",),
        prefix_hits=("mlx_lm:prompt_tokens_cached_total",),
        requests_done=("mlx_lm:requests_total",),
    ),
}
# every prefix the maps read under (what a scraper keeps)
PREFIXES = ("vllm:", "sglang:", "llamacpp:", "mlx_lm:")


def name_map(engine: str) -> NameMap:
    """The mapping for an engine family; vLLM's names for any other (the common dialect)."""
    return NAME_MAPS.get(engine, VLLM)


def parse_samples(text: str, wanted: set[str]) -> dict[str, float]:
    """Sum of the samples of each wanted metric name in a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name = line[:brace] if 0 <= brace < space else line[:space]
        if name not in wanted:
            continue
        value_text = line[line.rfind("}") + 1 :] if brace >= 0 else line[space:]
        try:
            value = float(value_text.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


def in_flight(text: str, names: NameMap) -> int | None:
    """Requests running plus waiting on a /metrics page; None when the page has neither."""
    samples = parse_samples(text, {*names.running, *names.waiting})
    found = [
        next((samples[n] for n in c if n in samples), None) for c in (names.running, names.waiting)
    ]
    if all(v is None for v in found):
        return None
    return int(sum(v or 0.0 for v in found))


# ---- the LoRA adapters an engine holds, in its own vocabulary (#60) ------------------------

LORA_LOADED = "cgn_infer_lora_loaded"  # cgn-infer: 1 per adapter it holds, {adapter}
LORA_SLOTS = "cgn_infer_lora_slots"  # cgn-infer: how many it holds at most (max_loras)
# vLLM: one series per label set it has shown, its value the time it was set; the newest
# names the adapters with requests running or waiting (not those idle: vllm #45325)
VLLM_LORA_INFO = "vllm:lora_requests_info"


def held_adapters(
    samples: Iterable[tuple[str, Mapping[str, str], float]], limit: int
) -> frozenset[str]:
    """The adapters a scraped page says the engine holds, from (name, labels, value)
    samples: valid names only, at most `limit` (the page is the engine's word)."""
    held: list[str] = []
    newest: tuple[float, Mapping[str, str]] | None = None
    for name, labels, value in samples:
        if name == LORA_LOADED and value == 1.0:
            held.append(labels.get("adapter", ""))
        elif (
            name == VLLM_LORA_INFO
            and math.isfinite(value)
            and (newest is None or value > newest[0])
        ):
            newest = (value, labels)
    if newest is not None:
        for label in ("running_lora_adapters", "waiting_lora_adapters"):
            held += newest[1].get(label, "")[: 64 << 10].split(",")
    return frozenset(itertools.islice((a for a in held if NAME.match(a)), limit))
