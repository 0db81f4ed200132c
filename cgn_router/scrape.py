"""Engine load from Prometheus text, read through the engine's name map (cgn_core.engine_metrics).

A page that has none of the names yields None: the endpoint's load is
unknown, and the scorers demote it.
"""

from __future__ import annotations

from cgn_core.engine_metrics import NAME_MAPS, VLLM, NameMap, name_map, parse_samples
from cgn_router.types import EngineLoad

__all__ = ["NAME_MAPS", "VLLM", "NameMap", "engine_load", "name_map", "parse_samples"]


def engine_load(text: str, names: NameMap, now: float) -> EngineLoad | None:
    """The load figures in a /metrics page, or None when it has none of them."""
    wanted = {*names.running, *names.waiting, *names.kv_usage}
    samples = parse_samples(text, wanted)

    def first(candidates: tuple[str, ...]) -> float | None:
        return next((samples[n] for n in candidates if n in samples), None)

    running, waiting, kv = first(names.running), first(names.waiting), first(names.kv_usage)
    if running is None and waiting is None:
        return None
    # NOTE: an engine's figures are clamped to what they can mean (counts >= 0, usage 0..1)
    return EngineLoad(
        min(max(running or 0.0, 0.0), 1e9),
        min(max(waiting or 0.0, 0.0), 1e9),
        min(max(kv or 0.0, 0.0), 1.0),
        now,
    )
