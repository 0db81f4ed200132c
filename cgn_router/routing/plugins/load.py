"""Queue/in-flight load scorer.

Two measures of what waits on an endpoint, each scaled to the candidates:

* requests: queue(e) = max(requests this router has in flight on e, the
  engine's own running + waiting);
* prefill work: the uncached prompt tokens this router has sent to e and not
  yet seen answered (what a new request's first token waits behind).

score = 1 - (queue / max queue + work / max work) / 2, so the idlest endpoint
scores 1 and one that is the busiest on both counts scores 0 (all 1 when
nothing waits anywhere). An endpoint without fresh metrics is demoted: only
the router's own counts are used and the score is halved (STALE_FACTOR).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.routing.plugins.base import SCORERS, Scores, register
from cgn_router.types import EndpointId, EndpointView, RequestInfo, queue_length

STALE_FACTOR = 0.5


def queue(view: EndpointView) -> float:
    """The endpoint's queue as best known: the router's count or the engine's, whichever is more."""
    return queue_length(view.in_flight, view.load)


def _share(value: float, top: float) -> float:
    return value / top if top > 0 else 0.0


@register(SCORERS, "load")
@dataclass(frozen=True, slots=True)
class LoadScorer:
    name: str = "load"

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
        queues = {v.id: queue(v) for v in views}
        top_q = max(queues.values(), default=0.0)
        top_w = float(max((v.pending_prefill for v in views), default=0))
        out: dict[EndpointId, float] = {}
        for v in views:
            busy = (_share(queues[v.id], top_q) + _share(v.pending_prefill, top_w)) / 2
            out[v.id] = (1.0 - busy) * (STALE_FACTOR if v.load is None else 1.0)
        return Scores(out)
