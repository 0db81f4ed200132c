"""The routing decision: filters → weighted scorers → picker, over a snapshot.

total(e) = Σ weight(s) · s(e) over the scorers s with a non-zero weight.
Weights come from `routing.*` settings and, live, from the etcd key
`/cognitora/policy/routing` (`set_weights`). `route` is pure apart from the
random generator it is given; it returns the whole decision so metrics and
`explain` can show why an endpoint won.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cgn_router.plugins import FILTERS, PICKERS
from cgn_router.plugins.base import Filter, Picker, Scorer
from cgn_router.plugins.prefix import PrefixScorer, min_pending
from cgn_router.settings import RoutingSettings
from cgn_router.types import EndpointId, EndpointView, RequestInfo

FILTER_ORDER = ("model", "role", "ready", "cordon", "breaker")
WEIGHT_NAMES = ("prefix", "load", "kv_usage", "affinity")


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: EndpointId | None  # None: every endpoint was filtered out
    view: EndpointView | None = None  # the chosen endpoint as it was scored
    totals: dict[EndpointId, float] = field(default_factory=dict)
    scores: dict[str, dict[EndpointId, float]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # per filter
    saturated: int = 0  # candidates the saturation guard held prefix credit back from


class Pipeline:
    """One configured routing pipeline."""

    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[Scorer],
        picker: Picker,
        weights: Mapping[str, float],
    ):
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.weights = dict(weights)

    @classmethod
    def from_settings(cls, s: RoutingSettings) -> Pipeline:
        from cgn_router.plugins.affinity import AffinityScorer
        from cgn_router.plugins.kv_usage import KvUsageScorer
        from cgn_router.plugins.load import LoadScorer

        return cls(
            [FILTERS[name]() for name in FILTER_ORDER],
            [
                PrefixScorer(s.saturation_tokens, s.ram_tier_weight, s.ssd_tier_weight),
                LoadScorer(),
                KvUsageScorer(),
                AffinityScorer(),
            ],
            PICKERS[s.picker](),
            weights_from(s),
        )

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Replace the scorer weights (validated by `check_weights`)."""
        self.weights = {**self.weights, **check_weights(weights)}

    def route(
        self, req: RequestInfo, views: Sequence[EndpointView], rng: random.Random
    ) -> Decision:
        dropped: dict[str, int] = {}
        candidates = list(views)
        for f in self.filters:
            kept = [v for v in candidates if f.keep(req, v)]
            if len(kept) != len(candidates):
                dropped[f.name] = len(candidates) - len(kept)
            candidates = kept
        if not candidates:
            return Decision(None, dropped=dropped)
        scores: dict[str, dict[EndpointId, float]] = {}
        totals = {v.id: 0.0 for v in candidates}
        for s in self.scorers:
            w = self.weights.get(s.name, 0.0)
            if w == 0.0:
                continue
            scores[s.name] = got = s.score(req, candidates)
            for eid, value in got.items():
                totals[eid] += w * value
        floor = min_pending(candidates)
        saturated = sum(
            1
            for s in self.scorers
            if isinstance(s, PrefixScorer)
            for v in candidates
            if v.matched_blocks and s.saturated(v, floor)
        )
        chosen = self.picker.pick(totals, rng)
        view = next(v for v in candidates if v.id == chosen)
        return Decision(chosen, view, totals, scores, dropped, saturated)


def weights_from(s: RoutingSettings) -> dict[str, float]:
    return check_weights({name: getattr(s, name) for name in WEIGHT_NAMES})


def check_weights(weights: Mapping[str, object]) -> dict[str, float]:
    """Validated scorer weights; ValueError names the first bad entry."""
    out: dict[str, float] = {}
    for name, value in weights.items():
        if name not in WEIGHT_NAMES:
            raise ValueError(f"unknown scorer {name!r} (known: {', '.join(WEIGHT_NAMES)})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
            raise ValueError(f"weight of {name!r} must be a number from 0 to 1e9, got {value!r}")
        out[name] = float(value)
    return out
