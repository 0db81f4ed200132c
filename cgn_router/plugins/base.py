"""The routing plugin interfaces and the registry that names them in config.

A request is routed in three stages over a snapshot of the endpoints
(`EndpointView`s, plain values): every `Filter` drops endpoints that cannot
serve it, every `Scorer` rates the survivors in [0, 1], and the `Picker`
chooses from the weighted sums. Plugins are pure: no I/O, no clocks, no
shared state; the randomness a picker needs is passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from cgn_router.types import EndpointId, EndpointView, RequestInfo


class Filter(Protocol):
    """Keeps the endpoints that can serve a request."""

    @property
    def name(self) -> str: ...

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        """True when `view` may serve `req`."""
        ...


class Scorer(Protocol):
    """Rates each candidate endpoint for a request, 0 (worst) to 1 (best)."""

    @property
    def name(self) -> str: ...

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> dict[EndpointId, float]:
        """A score in [0, 1] for every view."""
        ...


class Picker(Protocol):
    """Chooses one endpoint from the weighted score totals (never empty)."""

    @property
    def name(self) -> str: ...

    def pick(self, totals: Mapping[EndpointId, float], rng: random.Random) -> EndpointId:
        """The chosen endpoint."""
        ...


FILTERS: dict[str, Callable[..., Filter]] = {}
SCORERS: dict[str, Callable[..., Scorer]] = {}
PICKERS: dict[str, Callable[..., Picker]] = {}


def register(table: dict[str, Callable[..., Any]], name: str) -> Callable[[type], type]:
    """Class decorator: make a plugin constructible by `name` from config."""

    def add(cls: type) -> type:
        table[name] = cls
        return cls

    return add
