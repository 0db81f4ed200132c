"""Engines' Prometheus vocabularies, read under vLLM's meaning (docs/architecture.md).

Each engine family names the same signals differently; `NAME_MAPS` maps the
router's engine names (the `engine` field of an endpoint record) onto them.
A signal is the sum over all label sets of the first of its candidate names
present (engines with several ranks or models report one series each). The
router scores endpoints with these figures; the agent reads requests in
flight with them before it stops a draining engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NameMap:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]  # a fraction 0..1


VLLM = NameMap(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # v1, then v0
)
NAME_MAPS: dict[str, NameMap] = {
    "cgn-infer": VLLM,
    "vllm": VLLM,
    "sglang": NameMap(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
    ),
    # llama-server with --metrics; current builds export no KV-usage gauge.
    "llamacpp": NameMap(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
}


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
