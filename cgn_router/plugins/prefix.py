"""Prefix-overlap scorer with the saturation guard.

score = (leading prompt blocks the endpoint holds) / (blocks in the prompt).

Saturation guard: an endpoint whose pending uncached-prefill work (prompt
tokens routed to it and not yet answered, less what it had cached) exceeds the
least-loaded candidate's by `saturation_tokens` or more gets no prefix credit,
so a hot prefix stops pulling every request onto one replica; load then
decides, and the prefix gets computed on a second replica, which is warm for
the next requests. The bound is relative, so a fleet that is busy everywhere
still routes by cache. Tunable: `routing.saturation_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.plugins.base import SCORERS, register
from cgn_router.types import EndpointId, EndpointView, RequestInfo


@register(SCORERS, "prefix")
@dataclass(frozen=True, slots=True)
class PrefixScorer:
    saturation_tokens: int = 8192
    name: str = "prefix"

    def saturated(self, view: EndpointView, floor: int) -> bool:
        """The guard holds prefix credit back from `view` (`floor`: the least pending work)."""
        return view.pending_prefill - floor >= self.saturation_tokens

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> dict[EndpointId, float]:
        if not req.blocks:
            return {v.id: 0.0 for v in views}
        n = len(req.blocks)
        floor = min_pending(views)
        return {
            v.id: 0.0 if self.saturated(v, floor) else min(v.matched_blocks, n) / n for v in views
        }


def min_pending(views: Sequence[EndpointView]) -> int:
    return min((v.pending_prefill for v in views), default=0)
