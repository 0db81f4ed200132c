"""KV-usage scorer: score = 1 - the engine's KV cache usage (0 without fresh metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.routing.plugins.base import SCORERS, Scores, register
from cgn_router.types import EndpointView, RequestInfo


@register(SCORERS, "kv_usage")
@dataclass(frozen=True, slots=True)
class KvUsageScorer:
    name: str = "kv_usage"

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
        return Scores(
            {
                v.id: 0.0 if v.load is None else min(1.0, max(0.0, 1.0 - v.load.kv_usage))
                for v in views
            }
        )
