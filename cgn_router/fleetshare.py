"""Tenants' shares across routers (#58): who waits where, and who has had more (pure).

Within a router, admission shares a band's engine work between tenants by start-time fair
queuing (routing/admission.py), and a router's workers share their virtual times. Across
routers that is not enough: a router whose queue holds only tenant A admits A whenever a
slot frees, however much A has had, while tenant B waits at another router. So:

* every router worker publishes which tenants it has waiting, per band and pool
  (`/cognitora/waiting/<writer>`, rewritten every `budgets.publish_s` while it has a queue,
  deleted when it has none), with each one's weight;
* every worker keeps each tenant's fleet-wide rate of tokens served: its own requests as
  they end, and the growth of every other writer's usage record (ledger.py), decayed with
  time constant `TAU_S`;
* a worker defers its head of tenant T in a band and pool while another router has a
  tenant U waiting there whose weighted rate is below T's by more than `MARGIN`: the slot
  T would take goes to U at U's router. The tenant with the lowest weighted rate is never
  deferred, so the fleet always serves someone; a record not renewed within `STALE_PERIODS`
  publishing periods counts for nothing, so a router that died or emptied its queue holds
  nobody back for longer than that.

Converges within a few publishing periods plus one request's service time; the bound
and the measured shares are in docs/admission.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cgn_core.apikeys import MAX_WEIGHT, MIN_WEIGHT

TAU_S = 20.0  # the rates' memory: a tenant's share is over about this long
MARGIN = 0.05  # a tenant is deferred only for one that has had this much less (no flapping)
STALE_PERIODS = 3.0  # a waiting record older than this many publishing periods is ignored
MAX_QUEUES = 64  # (band, pool) pairs in one waiting record
MAX_TENANTS = 64  # tenants per (band, pool) in one record
MAX_NAME = 256

Waiting = dict[tuple[str, str], dict[str, float]]  # (band, pool) -> tenant -> weight


@dataclass(slots=True)
class Rate:
    value: float = 0.0  # tokens per second, decayed
    at: float = 0.0


@dataclass(slots=True)
class FleetShare:
    """One worker's view of every tenant's fleet-wide rate and of who waits at other
    routers."""

    tau_s: float = TAU_S
    rates: dict[str, Rate] = field(default_factory=dict)
    # writer -> (when its record came, what it has waiting); other routers' writers only
    theirs: dict[str, tuple[float, Waiting]] = field(default_factory=dict)

    def served(self, tenant: str, tokens: float, now: float) -> None:
        """`tokens` of `tenant`'s were served, here or anywhere (a record's growth). NOTE:
        on every request's end and every other writer's record: kept to one exp."""
        if not 0 < tokens < math.inf:  # NOTE: NaN fails this too
            return
        r = self.rates.get(tenant)
        if r is None:
            self.rates[tenant] = Rate(tokens / self.tau_s, now)
        elif now > r.at:
            r.value = r.value * math.exp((r.at - now) / self.tau_s) + tokens / self.tau_s
            r.at = now
        else:
            r.value += tokens / self.tau_s

    def rate(self, tenant: str, now: float) -> float:
        r = self.rates.get(tenant)
        return 0.0 if r is None else self._decayed(r, now)

    def _decayed(self, r: Rate, now: float) -> float:
        return r.value * math.exp(-max(0.0, now - r.at) / self.tau_s)

    def forget(self, now: float) -> None:
        """Drop the tenants whose rate has decayed to nothing (bounds the table)."""
        for tenant in [t for t, r in self.rates.items() if self._decayed(r, now) < 1e-3]:
            del self.rates[tenant]

    def put(self, writer: str, waiting: Waiting, now: float) -> None:
        if waiting:
            self.theirs[writer] = (now, waiting)
        else:
            self.theirs.pop(writer, None)

    def delete(self, writer: str) -> None:
        self.theirs.pop(writer, None)

    def waiting_elsewhere(
        self, band: str, pool: str, now: float, fresh_s: float
    ) -> dict[str, float]:
        """Tenant -> weight of those other routers have waiting in `band` and `pool`,
        from records that came within `fresh_s`."""
        out: dict[str, float] = {}
        for came, waiting in self.theirs.values():
            if now - came <= fresh_s:
                out.update(waiting.get((band, pool), {}))
        return out

    def defers(
        self, band: str, pool: str, tenant: str, weight: float, now: float, fresh_s: float
    ) -> bool:
        """Whether `tenant`'s head here waits for a tenant another router has waiting in
        `band` and `pool` that has had less, by weight."""
        theirs = self.waiting_elsewhere(band, pool, now, fresh_s)
        if not theirs:
            return False
        mine = self.rate(tenant, now) / max(weight, 1e-9)
        return any(
            u != tenant and self.rate(u, now) / max(w, 1e-9) < mine * (1 - MARGIN)
            for u, w in theirs.items()
        )


def to_doc(waiting: Mapping[tuple[str, str], Mapping[str, float]]) -> dict[str, Any]:
    """A worker's waiting record: `{"queues": [[band, pool, {tenant: weight}], ...]}`."""
    return {"queues": [[b, p, dict(ts)] for (b, p), ts in sorted(waiting.items()) if ts]}


def parse(doc: Any) -> Waiting:
    """A waiting record, bounded; ValueError naming what is wrong."""
    if not isinstance(doc, dict) or not isinstance(doc.get("queues"), list):
        raise ValueError("expected {queues: [[band, pool, {tenant: weight}], ...]}")
    queues = doc["queues"]
    if len(queues) > MAX_QUEUES:
        raise ValueError(f"queues: at most {MAX_QUEUES}")
    out: Waiting = {}
    for q in queues:
        if not (isinstance(q, list) and len(q) == 3 and all(map(_name, q[:2]))):
            raise ValueError("queues: each is [band, pool, {tenant: weight}]")
        tenants = q[2]
        if not isinstance(tenants, dict) or len(tenants) > MAX_TENANTS:
            raise ValueError(f"queues: at most {MAX_TENANTS} tenants each, as an object")
        for tenant, weight in tenants.items():
            if not _name(tenant) or not _weight(weight):
                raise ValueError(
                    f"queues: a tenant is a name with a weight in [{MIN_WEIGHT}, {MAX_WEIGHT}]"
                )
        out[q[0], q[1]] = {str(t): float(w) for t, w in tenants.items()}
    return out


def waiting_of(tickets: Iterable[tuple[str, str, str, float]]) -> Waiting:
    """(band, pool, tenant, weight) of each waiting head -> a record's content."""
    out: Waiting = {}
    for band, pool, tenant, weight in tickets:
        out.setdefault((band, pool), {})[tenant] = weight
    return out


def _name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _weight(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and MIN_WEIGHT <= value <= MAX_WEIGHT  # NOTE: NaN fails this too
    )
