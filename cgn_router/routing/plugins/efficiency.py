"""Efficiency scorer: prefer nodes that make more output tokens per joule (off by default).

score = the node's measured tokens per joule / the best candidate's. The figure is
cgn-metrics' (the agents' energy counters over the tokens the node's engines made,
published to `/cognitora/efficiency/<node>`, unused after 10 minutes). A candidate
without a figure gets the mean of the measured ones: unmeasured is neither rewarded
nor punished; with no figure at all every score is 0. Its default weight is 0: set
one in the routing policy (`{"weights": {"efficiency": 1}}`) to route on energy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.routing.plugins.base import SCORERS, Scores, register
from cgn_router.types import EndpointView, RequestInfo


@register(SCORERS, "efficiency")
@dataclass(frozen=True, slots=True)
class EfficiencyScorer:
    name: str = "efficiency"

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
        measured = {v.id: v.tokens_per_joule for v in views if v.tokens_per_joule}
        if not measured:
            return Scores({v.id: 0.0 for v in views})
        best = max(measured.values())
        scores = {eid: tpj / best for eid, tpj in measured.items()}
        neutral = sum(scores.values()) / len(scores)
        return Scores({v.id: scores.get(v.id, neutral) for v in views})
