"""Prefix-overlap scorer with the saturation guard.

score = (leading prompt blocks the endpoint holds
         + ram_weight * the next ones its node's cgn-kvcached holds in RAM
         + ssd_weight * the ones after those it holds on SSD) / (blocks in the prompt).

A block the engine must restore from its node's store is worth less than one
in its pool, and much more than one it must recompute: the weights are
1 - restore time / recompute time, from bench/results/kvcached_ttft.md
(tunable: the prefix scorer's `ram_weight` and `ssd_weight`). So a request whose prefix an engine
evicted still goes to that engine's node.

Saturation guard: an endpoint whose pending uncached-prefill work (prompt
tokens routed to it and not yet answered, less what it had cached) exceeds the
least-loaded candidate's by `saturation_tokens` or more gets no prefix credit,
so a hot prefix stops pulling every request onto one replica; load then
decides, and the prefix gets computed on a second replica, which is warm for
the next requests. The bound is relative, so a fleet that is busy everywhere
still routes by cache. Tunable: the prefix scorer's `saturation_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cgn_router.routing.plugins.base import SCORERS, Scores, register
from cgn_router.types import EndpointView, RequestInfo


@register(SCORERS, "prefix")
@dataclass(frozen=True, slots=True)
class PrefixScorer:
    saturation_tokens: int = 16384
    ram_weight: float = 0.9
    ssd_weight: float = 0.8
    name: str = "prefix"

    def __post_init__(self) -> None:
        if self.saturation_tokens <= 0:
            raise ValueError(f"saturation_tokens must be positive, got {self.saturation_tokens}")
        for key in ("ram_weight", "ssd_weight"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} must be between 0 and 1, got {getattr(self, key)}")

    def saturated(self, view: EndpointView, floor: int) -> bool:
        """The guard holds prefix credit back from `view` (`floor`: the least pending work)."""
        return view.pending_prefill - floor >= self.saturation_tokens

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
        if not req.blocks:
            return Scores(dict.fromkeys((v.id for v in views), 0.0))
        n, floor = len(req.blocks), min_pending(views)
        values, held_back = {}, 0
        for v in views:
            if self.saturated(v, floor):
                values[v.id] = 0.0
                held_back += v.matched_blocks > 0
            else:
                values[v.id] = self.held(v, n) / n
        return Scores(values, held_back)

    def held(self, v: EndpointView, n: int) -> float:
        """The prompt blocks `v` holds, node tiers discounted by their weight."""
        held = v.matched_blocks + self.ram_weight * v.node_ram_blocks
        return min(held + self.ssd_weight * v.node_ssd_blocks, float(n))


def min_pending(views: Sequence[EndpointView]) -> int:
    return min((v.pending_prefill for v in views), default=0)
