"""Engine load from Prometheus text, with a per-engine metric-name mapping.

Each engine family names the same signals differently; the router reads them
under vLLM's meaning (ARCHITECTURE.md §5). A signal is the sum over all label
sets of the first of its candidate names present (engines with several ranks
or models report one series each). A page that has none of the names yields
None: the endpoint's load is unknown, and the scorers demote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cgn_router.types import EngineLoad


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


def engine_load(text: str, names: NameMap, now: float) -> EngineLoad | None:
    """The load figures in a /metrics page, or None when it has none of them."""
    wanted = {*names.running, *names.waiting, *names.kv_usage}
    samples = parse_samples(text, wanted)

    def first(candidates: tuple[str, ...]) -> float | None:
        return next((samples[n] for n in candidates if n in samples), None)

    running, waiting, kv = first(names.running), first(names.waiting), first(names.kv_usage)
    if running is None and waiting is None:
        return None
    return EngineLoad(running or 0.0, waiting or 0.0, kv or 0.0, now)
