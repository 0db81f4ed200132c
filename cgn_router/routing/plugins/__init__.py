"""Routing plugins; importing this package registers every built-in one."""

from cgn_router.routing.plugins import (
    affinity,
    efficiency,
    filters,
    kv_usage,
    load,
    picker,
    prefix,
    ttft,
)
from cgn_router.routing.plugins.base import FILTERS, PICKERS, SCORERS, Filter, Picker, Scorer

__all__ = [
    "FILTERS",
    "PICKERS",
    "SCORERS",
    "Filter",
    "Picker",
    "Scorer",
    "affinity",
    "efficiency",
    "filters",
    "kv_usage",
    "load",
    "picker",
    "prefix",
    "ttft",
]
