"""Engine load from Prometheus text, read through the engine's name map (cgn_core.engine_metrics).

A page that has none of the names yields None: the endpoint's load is
unknown, and the scorers demote it.
"""

from __future__ import annotations

import re

from cgn_core.engine_metrics import (
    LORA_LOADED,
    LORA_SLOTS,
    NAME_MAPS,
    VLLM,
    NameMap,
    name_map,
    parse_samples,
)
from cgn_core.keys import MAX_ADAPTERS as MAX_PER_REPLICA
from cgn_core.keys import NAME
from cgn_router.types import EngineLoad

__all__ = [
    "NAME_MAPS",
    "VLLM",
    "NameMap",
    "adapter_slots",
    "engine_load",
    "loaded_adapters",
    "name_map",
    "parse_samples",
]
_ADAPTER_LABEL = re.compile(r'[{,]adapter="([^"\\]{1,128})"')


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


def adapter_slots(text: str) -> int | None:
    """How many adapters a cgn-infer page says it holds at most (`cgn_infer_lora_slots`);
    None where it does not say, or says something no engine could mean."""
    slots = parse_samples(text, {LORA_SLOTS}).get(LORA_SLOTS)
    return int(slots) if slots is not None and 1 <= slots <= MAX_PER_REPLICA else None


def loaded_adapters(text: str) -> set[str]:
    """The LoRA adapters a cgn-infer page says it holds (`cgn_infer_lora_loaded`, value 1):
    names checked, at most MAX_PER_REPLICA (the page is the engine's word)."""
    out: set[str] = set()
    for line in text.splitlines():
        if not line.startswith(LORA_LOADED + "{") or not line.rstrip().endswith(" 1.0"):
            continue
        m = _ADAPTER_LABEL.search(line)
        if m is not None and NAME.match(m.group(1)):
            out.add(m.group(1))
            if len(out) >= MAX_PER_REPLICA:
                break
    return out
