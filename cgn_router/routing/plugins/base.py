"""The routing plugin interfaces and the registry that names them in config.

A request is routed in three stages over a snapshot of the endpoints
(`EndpointView`s, plain values): every `Filter` drops endpoints that cannot
serve it, every `Scorer` rates the survivors in [0, 1], and the `Picker`
chooses from the weighted sums. Plugins are pure: no I/O, no clocks, no
shared state; the randomness a picker needs is passed in.

Each plugin registers its class under a type name (`@register(SCORERS,
"prefix")`); `build()` makes one from config (`routing.filters`,
`routing.scorers: [{type, weight, name, params}]`, `routing.picker`, or the
live policy in etcd), checking every parameter against the class's fields.
Adding a scorer is one module here, imported in `__init__.py`, plus its table
test (docs/cgn-router.md, "Writing a scorer").
"""

from __future__ import annotations

import dataclasses
import random
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cgn_router.types import EndpointId, EndpointView, RequestInfo


class Filter(Protocol):
    """Keeps the endpoints that can serve a request."""

    @property
    def name(self) -> str: ...

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        """True when `view` may serve `req`."""
        ...


@dataclass(frozen=True, slots=True)
class Scores:
    """A scorer's verdict: a value in [0, 1] per candidate, and what it held back."""

    values: dict[EndpointId, float] = field(default_factory=dict)
    # candidates that earned credit the scorer withheld to protect them (the prefix
    # scorer's saturation guard): counted in cgn_router_saturation_guard_total
    held_back: int = 0
    # seconds to the first token the scorer predicts per candidate (the time scorer)
    predicted_s: dict[EndpointId, float] = field(default_factory=dict)


class Scorer(Protocol):
    """Rates each candidate endpoint for a request, 0 (worst) to 1 (best)."""

    @property
    def name(self) -> str: ...

    def score(self, req: RequestInfo, views: Sequence[EndpointView]) -> Scores:
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


def build(
    table: Mapping[str, Callable[..., Any]],
    kind: str,
    type_: str,
    name: str = "",
    params: Mapping[str, object] | None = None,
) -> Any:
    """A `kind` plugin of registered type `type_`, named `name` (default: the type), with
    `params` checked against its fields; ValueError says what is wrong."""
    cls = table.get(type_)
    if cls is None:
        raise ValueError(f"unknown {kind} {type_!r} (known: {', '.join(sorted(table))})")
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "name"]  # type: ignore[arg-type]
    kwargs: dict[str, object] = {}
    for key, value in (params or {}).items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise ValueError(f"{kind} {type_!r}: unknown parameter {key!r} (known: {known})")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{kind} {type_!r}: parameter {key!r} must be a number")
        if hints[key] is int:
            if value != int(value):
                raise ValueError(f"{kind} {type_!r}: parameter {key!r} must be a whole number")
            value = int(value)
        kwargs[key] = value
    try:
        return cls(name=name or type_, **kwargs)
    except ValueError as exc:
        raise ValueError(f"{kind} {type_!r}: {exc}") from None
