"""Predicted-time scorer: each candidate's time to first token, at its own learned speed (#57).

    predicted(e) = (overhead(e) + prefill(e) · (queued(e) + uncached(e))
                    + per_other(e) · in_flight(e)) · lag(e)

`queued`: the uncached prompt tokens routed to e and not yet computed (what the request
waits behind; `EndpointView.queued_tokens`, the registry's drain clock); `in_flight`: the
requests there (their decode steps share the engine's steps with this one's prefill);
`uncached`: the prompt tokens e does not hold, where a block its node's KV store holds
costs `ram_cost` (RAM) or `ssd_cost` (SSD) of computing it (restoring is faster than
recomputing: bench/results/kvcached_ttft.md). The rest is the endpoint's learned speed
(`EndpointView.speed`, cgn_router/routing/speed.py), so a replica ten times slower
predicts ten times the time for the same work, and a cached prefix on a slow replica
loses to a cold fast one when computing it there is faster.
`lag`: how many times longer than predicted e's oldest waiting stream has waited (at
least 1): a replica slower than learned (a cold one priced at its peers' speed, one that
slowed or hung) is priced by what it is doing before any answer can teach its fit.

score = fastest prediction / predicted(e): 1 for the fastest candidate, 0.1 for one
predicted ten times slower, and 0 for an untried replica that is busy: one whose speed
nothing has taught yet (`Speed.warm` false: it is priced at its peers' median) and that
already has a request in flight, while a candidate beside it has learned its own. An
untried replica takes one request at a time until an answer (or a stream moved off it for
lateness) teaches its speed: a replica ten times slower than the median it is priced at
would otherwise take request after request before its first answer says so
(bench/results/hetero_fleet.md). When no candidate has learned yet (a fleet starting),
none is held back. The predictions themselves go with the decision
(`Scores.predicted_s`): the response's `x-cognitora-predicted-ttft-ms` and the
prediction-error metric read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_router.routing.plugins.base import SCORERS, Scores, register
from cgn_router.types import EndpointId, EndpointView, RequestInfo

FLOOR_S = 1e-4  # no prediction is below this (a score divides by it)


@register(SCORERS, "time")
@dataclass(frozen=True, slots=True)
class TimeScorer:
    ram_cost: float = 0.1  # a block restored from the node's RAM, as a share of computing it
    ssd_cost: float = 0.2  # and from its SSD
    name: str = "time"

    def __post_init__(self) -> None:
        for key in ("ram_cost", "ssd_cost"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} must be between 0 and 1, got {getattr(self, key)}")

    def uncached(self, req: RequestInfo, v: EndpointView) -> float:
        """The prompt tokens `v` must compute, node-store blocks at their restore cost."""
        total = float(req.prompt_tokens)
        pool = min(total, v.matched_blocks * BLOCK_SIZE)
        ram = min(total - pool, v.node_ram_blocks * BLOCK_SIZE)
        ssd = min(total - pool - ram, v.node_ssd_blocks * BLOCK_SIZE)
        return total - pool - ram - ssd + self.ram_cost * ram + self.ssd_cost * ssd

    def predict(self, req: RequestInfo, v: EndpointView) -> float:
        """Seconds to `req`'s first token on `v`."""
        work = v.queued_tokens + self.uncached(req, v)
        return max(FLOOR_S, v.speed.ttft(work, others=v.in_flight) * v.lag)

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
        predicted: dict[EndpointId, float] = {v.id: self.predict(req, v) for v in views}
        learned = any(v.speed.warm for v in views)
        held = {v.id for v in views if learned and untried_and_busy(v)}
        best = min((p for e, p in predicted.items() if e not in held), default=FLOOR_S)
        return Scores(
            {e: 0.0 if e in held else best / p for e, p in predicted.items()},
            predicted_s=predicted,
        )


def untried_and_busy(v: EndpointView) -> bool:
    """`v` has a request in flight and no speed of its own yet (see the module docstring)."""
    return not v.speed.warm and v.in_flight > 0
