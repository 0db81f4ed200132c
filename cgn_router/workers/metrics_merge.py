"""Several workers' Prometheus pages as one: what a router with `--workers N` shows.

Counters, histograms and summaries are added up (their `_created` stamps: the
earliest). Gauges are added up too (requests in flight, queue depths), except
those in `VIEW_GAUGES`: each worker's view of the same fleet (breakers,
staleness, KV blocks held, saturation), where the largest is shown. Families
and samples keep the order of the first page that has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Family:
    head: list[str] = field(default_factory=list)  # its HELP and TYPE lines
    kind: str = "untyped"
    samples: dict[str, float] = field(default_factory=dict)  # "name{labels}" -> value


# Gauges that are each worker's view of one fleet, not a share of the router's work: with
# several workers the largest is shown, not the sum.
VIEW_GAUGES = frozenset(
    {
        "cgn_router_pool_saturation",
        "cgn_router_endpoint_breaker_open",
        "cgn_router_endpoint_metrics_stale",
        "cgn_router_endpoint_kv_blocks",
        "cgn_autoscaler_desired_replicas",
        "cgn_autoscaler_current_replicas",
        "cgn_router_tenant_budget_remaining",
    }
)


def merge_pages(pages: list[str]) -> str:
    families: dict[str, _Family] = {}
    for page in pages:
        current: _Family | None = None
        for line in page.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                    continue
                current = families.get(parts[2])
                if current is None:
                    current = families[parts[2]] = _Family()
                if parts[1] == "TYPE" and len(parts) == 4:
                    current.kind = parts[3]
                if len(current.head) < 2 and line not in current.head:
                    current.head.append(line)
                continue
            if not line or current is None:
                continue
            key, _, value = line.rpartition(" ")
            try:
                number = float(value)
            except ValueError:
                continue
            current.samples[key] = _combine(current, key, current.samples.get(key), number)
    lines: list[str] = []
    for fam in families.values():
        lines += fam.head
        lines += [f"{key} {_number(v)}" for key, v in fam.samples.items()]
    return "\n".join(lines) + "\n"


def _combine(fam: _Family, key: str, have: float | None, new: float) -> float:
    if have is None:
        return new
    name = key.split("{", 1)[0]
    if name.endswith("_created"):
        return min(have, new)
    if fam.kind == "gauge" and name in VIEW_GAUGES:
        return max(have, new)
    return have + new


def _number(v: float) -> str:
    """As prometheus_client writes it (integers without a fraction; +Inf, NaN)."""
    if v == float("inf"):
        return "+Inf"
    if v == float("-inf"):
        return "-Inf"
    if v != v:
        return "NaN"
    return repr(float(v))
