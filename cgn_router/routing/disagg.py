"""Whether a request is split into a prefill leg and a decode leg (pure; table-tested).

Disaggregation does not raise throughput: it keeps a long prefill off the
decode replica, whose running streams would otherwise stall behind it, and
lets each pool be sized on its own. So a request is split only when

    the model has a prefill pool            (else: no_prefill_pool)
    and P/D is on                           (else: disabled)
    and the prompt's uncached part on the
        chosen decode replica is long       (else: short_prompt; pd.min_uncached_tokens)
    and a prefill replica can take it now   (else: prefill_busy; pd.max_prefill_queue
                                             requests running or waiting there, or none)

The reason is a label of `cgn_router_pd_decisions_total` and the value of the
response's `x-cognitora-pd` header.
"""

from __future__ import annotations

from dataclasses import dataclass

from cgn_router.settings import PdSettings


@dataclass(frozen=True, slots=True)
class Split:
    split: bool
    reason: str  # "split", or why not


def decide(
    s: PdSettings, *, prefill_pool: bool, uncached_tokens: int, prefill_queue: int | None
) -> Split:
    """`prefill_queue`: requests running and waiting on the best prefill candidate (the
    router's own in-flight count where the engine's is unknown); None: no candidate."""
    if not prefill_pool:
        return Split(False, "no_prefill_pool")
    if not s.enabled:
        return Split(False, "disabled")
    if uncached_tokens < s.min_uncached_tokens:
        return Split(False, "short_prompt")
    if prefill_queue is None or prefill_queue > s.max_prefill_queue:
        return Split(False, "prefill_busy")
    return Split(True, "split")
