"""Session-affinity scorer: 1 for the endpoint the request's session last went to, else 0."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.routing.plugins.base import SCORERS, Scores, register
from cgn_router.types import EndpointView, RequestInfo


@register(SCORERS, "affinity")
@dataclass(frozen=True, slots=True)
class AffinityScorer:
    name: str = "affinity"

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
        owner = req.session is not None
        return Scores({v.id: 1.0 if owner and v.session_owner else 0.0 for v in views})
