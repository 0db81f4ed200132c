"""Pickers: the best total with a random tie-break, or the better of two random candidates."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from cgn_router.routing.plugins.base import PICKERS, register
from cgn_router.types import EndpointId

TIE = 1e-9  # totals this close are a tie


@register(PICKERS, "max")
@dataclass(frozen=True, slots=True)
class MaxScorePicker:
    name: str = "max"

    def pick(self, totals: Mapping[EndpointId, float], rng: random.Random) -> EndpointId:
        best = max(totals.values())
        return rng.choice([e for e, t in totals.items() if t >= best - TIE])


@register(PICKERS, "p2c")
@dataclass(frozen=True, slots=True)
class PowerOfTwoPicker:
    """Power of two choices: sample two candidates, keep the higher total (ties: random)."""

    name: str = "p2c"

    def pick(self, totals: Mapping[EndpointId, float], rng: random.Random) -> EndpointId:
        ids = list(totals)
        if len(ids) == 1:
            return ids[0]
        a, b = rng.sample(ids, 2)
        if abs(totals[a] - totals[b]) <= TIE:
            return rng.choice((a, b))
        return a if totals[a] > totals[b] else b


@register(PICKERS, "round_robin")
@dataclass(slots=True)
class RoundRobinPicker:
    """Each candidate in turn, ignoring scores: the baseline the benchmarks compare against.

    NOTE: the one stateful plugin (a counter); it is not meant for production routing.
    """

    name: str = "round_robin"
    turn: int = 0

    def pick(self, totals: Mapping[EndpointId, float], rng: random.Random) -> EndpointId:
        ids = sorted(totals)
        self.turn += 1
        return ids[self.turn % len(ids)]
