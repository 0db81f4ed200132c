"""Queue/in-flight load scorer.

queue(e) = max(requests this router has in flight on e, the engine's own
running + waiting); score = 1 - queue / max queue over the candidates (all 1
when every queue is empty). An endpoint without fresh metrics is demoted: only
the router's own count is used and the score is halved (STALE_FACTOR).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.plugins.base import SCORERS, register
from cgn_router.types import EndpointId, EndpointView, RequestInfo


def queue(view: EndpointView) -> float:
    """The endpoint's queue as best known: the router's count or the engine's, whichever is more."""
    engine = view.load.running + view.load.waiting if view.load is not None else 0.0
    return max(float(view.in_flight), engine)


STALE_FACTOR = 0.5


@register(SCORERS, "load")
@dataclass(frozen=True, slots=True)
class LoadScorer:
    name: str = "load"

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> dict[EndpointId, float]:
        queues = {v.id: queue(v) for v in views}
        top = max(queues.values(), default=0.0)
        out = {v.id: 1.0 - queues[v.id] / top if top > 0 else 1.0 for v in views}
        for v in views:
            if v.load is None:
                out[v.id] *= STALE_FACTOR
        return out
