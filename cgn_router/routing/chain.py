"""The routing decision: filters → weighted scorers → picker, over a snapshot.

total(e) = Σ weight(s) · s(e) over the scorers s with a non-zero weight.

The chain is built through the plugin registries from a `Policy`: the
`routing.filters / scorers / picker` settings, or the live etcd key
`/cognitora/policy/routing`, whose value either re-weights the configured
scorers (`{"weights": {"prefix": 2.0}}`) or replaces the policy
(`{"scorers": [{"type": "load", "weight": 1}], "picker": "p2c"}`; parts left
out keep their settings). `route` is pure apart from the random generator it
is given; it returns the whole decision so metrics and `explain` can show why
an endpoint won.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cgn_router.routing.plugins import FILTERS, PICKERS, SCORERS
from cgn_router.routing.plugins.base import Filter, Picker, Scorer, build
from cgn_router.settings import RoutingSettings, ScorerSpec
from cgn_router.types import EndpointId, EndpointView, RequestInfo

MAX_WEIGHT = 1e9


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: EndpointId | None  # None: every endpoint was filtered out
    view: EndpointView | None = None  # the chosen endpoint as it was scored
    totals: dict[EndpointId, float] = field(default_factory=dict)
    scores: dict[str, dict[EndpointId, float]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # per filter
    saturated: int = 0  # candidates the scorers held credit back from (saturation guard)
    # the predicted seconds to first token per candidate (a time scorer in the chain)
    predicted_s: dict[EndpointId, float] = field(default_factory=dict)

    @property
    def predicted_ttft_s(self) -> float | None:
        """The chosen endpoint's predicted time to first token (None: nothing predicted)."""
        return self.predicted_s.get(self.chosen) if self.chosen is not None else None


@dataclass(frozen=True, slots=True)
class Policy:
    """What a chain is made of, by registered plugin names."""

    filters: tuple[str, ...]
    scorers: tuple[ScorerSpec, ...]
    picker: str

    @classmethod
    def from_settings(cls, s: RoutingSettings) -> Policy:
        return cls(s.filters, s.scorers, s.picker)


class RoutingChain:
    """One configured routing chain."""

    def __init__(
        self, filters: Sequence[Filter], scorers: Sequence[tuple[Scorer, float]], picker: Picker
    ):
        self.filters = tuple(filters)
        self.scorers = tuple(s for s, _ in scorers)
        self.weights = {s.name: w for s, w in scorers}
        self.picker = picker

    @classmethod
    def build(cls, policy: Policy) -> RoutingChain:
        """A chain of registered plugins; ValueError names the first bad part."""
        filters = [build(FILTERS, "filter", name) for name in policy.filters]
        scorers = []
        for spec in policy.scorers:
            scorer = build(SCORERS, "scorer", spec.type, spec.name, spec.params)
            scorers.append((scorer, check_weight(scorer.name, spec.weight)))
        names = [s.name for s, _ in scorers]
        if len(set(names)) != len(names):
            raise ValueError(f"scorer names must differ (give each a `name`): {names}")
        return cls(filters, scorers, build(PICKERS, "picker", policy.picker))

    @classmethod
    def from_settings(cls, s: RoutingSettings) -> RoutingChain:
        return cls.build(Policy.from_settings(s))

    def set_weights(self, weights: Mapping[str, object]) -> None:
        """Re-weight scorers by name; ValueError (and no change) for an unknown one."""
        checked = {}
        for name, value in weights.items():
            if name not in self.weights:
                known = ", ".join(self.weights)
                raise ValueError(f"unknown scorer {name!r} (known: {known})")
            checked[name] = check_weight(name, value)
        self.weights |= checked

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
        saturated = 0
        predicted: dict[EndpointId, float] = {}
        for s in self.scorers:
            w = self.weights[s.name]
            if w == 0.0:
                continue
            got = s.score(req, candidates)
            scores[s.name], saturated = got.values, saturated + got.held_back
            predicted = got.predicted_s or predicted
            for eid, value in got.values.items():
                totals[eid] += w * value
        chosen = self.picker.pick(totals, rng)
        view = next(v for v in candidates if v.id == chosen)
        if chosen in predicted:
            view = replace(view, predicted_ttft_s=predicted[chosen])
        return Decision(chosen, view, totals, scores, dropped, saturated, predicted)


def check_weight(name: str, value: object) -> float:
    """`value` as a scorer weight; ValueError unless it is a number in [0, 1e9)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < MAX_WEIGHT:
        raise ValueError(f"weight of {name!r} must be a number from 0 to 1e9, got {value!r}")
    return float(value)


def chain_from_policy(doc: Any, base: Policy) -> RoutingChain:
    """The chain a `/cognitora/policy/routing` value asks for; ValueError says why not.

    `{"weights": {...}}` (or the bare mapping) keeps `base` and re-weights it; a value
    with `scorers`, `filters` or `picker` replaces those parts of `base`."""
    if not isinstance(doc, dict):
        raise ValueError("the routing policy must be a JSON object")
    parts = {"filters", "scorers", "picker", "weights"}
    if not parts & doc.keys():
        doc = {"weights": doc}
    if unknown := sorted(doc.keys() - parts):
        raise ValueError(f"unknown policy field(s) {unknown} (known: {sorted(parts)})")
    policy = base
    if "filters" in doc:
        filters = doc["filters"]
        if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
            raise ValueError("'filters' must be a list of filter names")
        policy = replace(policy, filters=tuple(filters))
    if "scorers" in doc:
        if not isinstance(doc["scorers"], list):
            raise ValueError("'scorers' must be a list of {type, weight, name, params}")
        policy = replace(policy, scorers=tuple(_scorer_spec(x) for x in doc["scorers"]))
    if "picker" in doc:
        if not isinstance(doc["picker"], str):
            raise ValueError("'picker' must be a picker name")
        policy = replace(policy, picker=doc["picker"])
    weights = doc.get("weights", {})
    if not isinstance(weights, dict):
        raise ValueError("'weights' must map scorer names to numbers")
    chain = RoutingChain.build(policy)
    chain.set_weights(weights)
    return chain


def _scorer_spec(item: Any) -> ScorerSpec:
    fields = {"type", "weight", "name", "params"}
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        raise ValueError("each scorer must be an object with a 'type'")
    if unknown := sorted(item.keys() - fields):
        raise ValueError(f"scorer {item['type']!r}: unknown field(s) {unknown}")
    params, name = item.get("params", {}), item.get("name", "")
    if not isinstance(params, dict) or not isinstance(name, str):
        raise ValueError(f"scorer {item['type']!r}: 'params' must be an object, 'name' a string")
    weight = check_weight(name or item["type"], item.get("weight", 1.0))
    return ScorerSpec(item["type"], weight, name, params)
