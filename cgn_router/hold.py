"""Requests held at the router while no replica can meet their model's TTFT SLO (#57).

With a `time` scorer in the chain, each decision predicts the chosen replica's time to
the request's first token. When even the best prediction misses the model's SLO
(`slo.ttft_p90_ms` in its catalog entry; `models.<name>.ttft_slo_ms` for a router
without etcd), sending the request now binds it to one replica's queue, where it waits
whatever happens elsewhere. With `routing.hold_for_slo` (off by default: measured worse
on a real fleet under load, bench/results/mixed_fleet_held.md) it waits here instead, in
a queue per model:

* the queue is FIFO: a request that comes while others are held joins behind them;
* its head re-routes every `RECHECK_S`, and goes as soon as a replica's prediction meets
  the SLO (one freed, its queue drained), to whichever replica that is; the next one then
  checks at once;
* a request is not held where holding cannot help: a prediction meets the SLO, the chosen
  replica has nothing in flight (its wait is its own work), or the request's own work
  there alone misses the SLO (a long prompt);
* it is held at most until `until` (its band's admission `ttl_s`, within its deadline):
  then it goes to the best replica as it is. A client that leaves, leaves the queue.

`cgn_router_held_seconds{model,result}` is a histogram of holds by how they ended
(released, expired, gone); the response says `x-cognitora-held-ms`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Literal

from cgn_router.routing.plugins.ttft import TimeScorer
from cgn_router.types import EndpointView, RequestInfo

RECHECK_S = 0.05  # the head of a queue re-routes this often
HOLD_MAX_S = 60.0  # held at most this long where admission has no band TTL to say
Result = Literal["released", "expired", "gone"]
_WORK = TimeScorer()


def meets(view: EndpointView, req: RequestInfo, slo_s: float) -> bool:
    """Whether `req` may go to `view` now (see the module docstring)."""
    predicted = view.predicted_ttft_s
    if predicted is None or predicted <= slo_s or view.in_flight == 0:
        return True
    alone = view.speed.ttft(_WORK.uncached(req, view)) * view.lag
    return alone > slo_s


class Holds:
    """The held requests of one router worker, a FIFO per model."""

    def __init__(self, recheck_s: float = RECHECK_S) -> None:
        self.recheck_s = recheck_s
        self._queues: dict[str, list[asyncio.Event]] = {}

    def held(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    async def hold(
        self,
        req: RequestInfo,
        view: EndpointView,
        slo_s: float,
        until: float,
        best: Callable[[], EndpointView | None],
    ) -> tuple[EndpointView | None, float, Result] | None:
        """None where `view` may take `req` now; else (the view it goes to, None: no candidate
        left; the seconds it was held; why it went). `best`: the chain's pick now."""
        queue = self._queues.get(req.model)
        if not queue and meets(view, req, slo_s):
            return None
        queue = self._queues.setdefault(req.model, [])
        me = asyncio.Event()
        queue.append(me)
        started = time.monotonic()
        result: Result = "gone"
        chosen: EndpointView | None = view
        try:
            while (left := until - time.monotonic()) > 0:
                if queue[0] is not me:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await me.wait()
                    continue
                chosen = best()
                if chosen is None or meets(chosen, req, slo_s):
                    result = "released"
                    break
                await asyncio.sleep(min(left, self.recheck_s))
            else:
                chosen, result = best(), "expired"
        finally:
            queue.remove(me)
            if queue:
                queue[0].set()  # the next one checks at once
            else:
                del self._queues[req.model]
        return chosen, time.monotonic() - started, result
