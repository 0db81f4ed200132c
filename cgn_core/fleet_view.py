"""The fleet view cgn-metrics serves (`GET /api/v1/fleet`) as typed values, one shape for all.

cgn-metrics builds it (cgn_metrics/fleet.py:summarize), serves it with `to_json` and
exports its figures (cgn_metrics/server.py); `cgn-ctl top` reads it back with
`from_json`; the dashboard draws the JSON. The field names are the JSON's keys, so
nothing re-spells them. A figure there is no measurement for is None ("no figure"),
never 0.

`from_json` does not trust its input (another machine's answer): a row that is not an
object is left out, a number that is not a finite one is None, a missing or mistyped
text is "", and every list is bounded by what the reader was allowed to read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

Quantiles = dict[str, float | None]  # "p50" | "p95" | "p99" -> seconds


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One engine replica, as its metrics say."""

    model: str
    replica: str
    node: str
    url: str
    state: str  # pending | up | down
    error: str
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0-1
    prefix_hit_rate: float | None
    tokens_per_s: float | None  # output tokens
    # its speed as the routers learned it from its answers (#57), once learned
    prefill_ms_per_token: float | None = None
    decode_ms_per_token: float | None = None
    # LoRA adapters it holds: loaded at start, and what its metrics say it holds now (#60)
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeView:
    """One machine: its state, and what its agent measured of its power."""

    node: str
    state: str  # Ready | NotReady | Cordoned | Unknown
    agent: str  # up | down | pending | absent
    watts: float | None
    source: str  # rapl | nvml | powermetrics | ... | unavailable
    joules: float | None  # over the window
    j_per_output_token: float | None
    j_per_token: float | None  # prompt and output tokens
    tokens_per_joule: float | None


@dataclass(frozen=True, slots=True)
class ModelView:
    model: str
    replicas: int  # placed
    ready: int  # answering
    desired: int | None  # the autoscaler's target; None: none
    tokens_per_s: float | None
    j_per_output_token: float | None


@dataclass(frozen=True, slots=True)
class StoreView:
    """One node's KV store (cgn-kvcached)."""

    node: str
    state: str
    bytes: dict[str, float]  # tier -> bytes held
    hits_per_s: float | None
    misses_per_s: float | None


@dataclass(frozen=True, slots=True)
class TargetView:
    """One scraped target."""

    id: str
    kind: str  # engine | agent | router | kvcached
    url: str
    node: str
    model: str
    state: str
    error: str
    age_s: float | None  # since its last good scrape
    scrape_ms: float | None


@dataclass(frozen=True, slots=True)
class TenantView:
    """One tenant's traffic over every router (cgn_router_tenant_tokens_total)."""

    tenant: str  # "other": the tenants past a router worker's first 50
    tokens_per_s: float | None  # prompt and completion
    prompt_tokens_per_s: float | None
    hit_rate: float | None  # cached prompt tokens over prompt tokens: its own cache's


@dataclass(frozen=True, slots=True)
class Totals:
    requests_per_s: float | None
    tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    ttft_s: Quantiles
    itl_s: Quantiles
    waiting: float | None
    running: float | None
    queue_by_band: dict[str, float]
    rejected_per_s_by_band: dict[str, float | None]
    watts: float | None
    power_nodes: int
    j_per_output_token: float | None
    energy_source: str  # the nodes' sources joined by "+", or "unavailable"


@dataclass(frozen=True, slots=True)
class FleetView:
    time: float  # unix seconds of the scrape round
    window_s: float
    covered_s: float  # what the kept samples cover of the window
    totals: Totals
    nodes: tuple[NodeView, ...] = ()
    models: tuple[ModelView, ...] = ()
    replicas: tuple[ReplicaView, ...] = ()
    kvcached: tuple[StoreView, ...] = ()
    targets: tuple[TargetView, ...] = ()
    tenants: tuple[TenantView, ...] = ()  # the busiest, most tokens first
    etcd_error: str = ""  # etcd did not answer: the fleet shown is the last one read

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> FleetView:
        """A view read back from JSON, every field checked (see the module's docstring)."""
        return _read(cls, data if isinstance(data, Mapping) else {})


T = TypeVar("T")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)
    except OverflowError:  # a 400-digit integer
        return None
    return f if math.isfinite(f) else None


def _value(kind: Any, value: Any) -> Any:
    """`value` as `kind` (one of the annotations above), or its "no figure"."""
    origin, args = get_origin(kind), get_args(kind)
    if kind is str:
        return value if isinstance(value, str) else ""
    if kind is float:
        return _num(value) or 0.0
    if kind is int:
        n = _num(value)
        return int(n) if n is not None and abs(n) < 2**53 else 0
    if kind == float | None:
        return _num(value)
    if kind == int | None:
        n = _num(value)
        return int(n) if n is not None and abs(n) < 2**53 else None
    if origin is dict:  # of figures by name: one that is not a number is left out
        if not isinstance(value, Mapping):
            return {}
        return {
            k: None if n is None else float(n)
            for k, raw in value.items()
            if isinstance(k, str) and ((n := _num(raw)) is not None or args[1] is not float)
        }
    if origin is tuple:
        row = args[0]
        if not isinstance(value, list | tuple):
            return ()
        if row is str:  # names: one that is not a string is left out
            return tuple(v for v in value if isinstance(v, str))
        return tuple(_read(row, r) for r in value if isinstance(r, Mapping))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _read(kind, value if isinstance(value, Mapping) else {})
    raise TypeError(f"no reader for {kind!r}")  # a field type added above without one


def _read(cls: type[T], data: Mapping[str, Any]) -> T:
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return cls(**{f.name: _value(hints[f.name], data.get(f.name)) for f in fields})
