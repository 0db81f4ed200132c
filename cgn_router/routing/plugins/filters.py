"""Filters: model, role, ready, breaker and cordon (each a one-line rule)."""

from __future__ import annotations

from dataclasses import dataclass

from cgn_router.routing.plugins.base import FILTERS, register
from cgn_router.types import EndpointView, RequestInfo


@register(FILTERS, "model")
@dataclass(frozen=True, slots=True)
class ModelFilter:
    """The endpoint serves the request's model (aliases are resolved before routing)."""

    name: str = "model"

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        return view.endpoint.model == req.model


@register(FILTERS, "role")
@dataclass(frozen=True, slots=True)
class RoleFilter:
    """The endpoint plays the role the request needs; a `both` endpoint plays any.

    A whole request (role `both`) goes to `both` endpoints only: a prefill-only
    or decode-only replica serves its half of a disaggregated request.
    """

    name: str = "role"

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        return view.endpoint.role in ("both", req.role)


@register(FILTERS, "ready")
@dataclass(frozen=True, slots=True)
class ReadyFilter:
    """The endpoint is registered as Ready."""

    name: str = "ready"

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        return view.ready


@register(FILTERS, "breaker")
@dataclass(frozen=True, slots=True)
class BreakerFilter:
    """The endpoint's circuit breaker lets a request through."""

    name: str = "breaker"

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        return not view.breaker_open


@register(FILTERS, "cordon")
@dataclass(frozen=True, slots=True)
class CordonFilter:
    """The endpoint's node is not cordoned."""

    name: str = "cordon"

    def keep(self, req: RequestInfo, view: EndpointView) -> bool:
        return not view.cordoned
