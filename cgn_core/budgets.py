"""Tenants' budgets over days and months, and the usage records every router publishes (#58).

A tenant's record at `/cognitora/tenants/<tenant>` (written by `cgn-ctl tenants
set`) carries its budget:

    {"tenant": "acme", "budget": {"tokens_per_day": 2000000, "tokens_per_month": null,
     "joules_per_day": 50000.0}, "note": ""}

Periods are UTC calendar days and months: a day's budget resets at 00:00 UTC, a
month's on its first day. Each router worker counts what it served (prompt and
completion tokens from the answers' usage; joules where its node's efficiency is
measured) and publishes it per tenant at `/cognitora/usage/<writer>/<tenant>`,
only the tenants whose count changed since its last write, kept across its
restarts (it resumes from its own records) and counted by every other router
until its month is over:

    ["2026-12-06", 1200, 54000, 3.5]

(the day, tokens that day, tokens that month, joules that day). An API key
with a budget of its own (`cgn-ctl keys create --tokens-per-day ...`) is counted
the same way under `@<key id>` in place of a tenant. A tenant's usage is the sum
over every writer's record of the same period. One record per writer and
tenant keeps each update as small as what changed: a router follows the
others' traffic, not the size of the tenant list. Pure: no I/O; the router's
ledger (cgn_router/ledger.py) and `cgn-ctl tenants` share it.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from cgn_core import records

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # as API keys' tenants
# what a budget and a usage record belong to: a tenant, or "@<key id>" for a key with a
# budget of its own (no tenant name starts with "@")
SCOPE_NAME = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,63}|@[0-9a-f]{8})$")
WRITER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_BUDGET = float(records.MAX_INT)
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class BudgetError(ValueError):
    """A budget, tenant or usage record that cannot be accepted; the message names the field."""


@dataclass(frozen=True, slots=True)
class Budget:
    """What a tenant may consume per period; None: no limit on that."""

    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    joules_per_day: float | None = None

    @property
    def empty(self) -> bool:
        return (
            self.tokens_per_day is None
            and self.tokens_per_month is None
            and (self.joules_per_day is None)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_per_day": self.tokens_per_day,
            "tokens_per_month": self.tokens_per_month,
            "joules_per_day": self.joules_per_day,
        }


def budget(
    tokens_per_day: float | None, tokens_per_month: float | None, joules_per_day: float | None
) -> Budget:
    """A budget from figures a person typed; BudgetError names a figure that is not positive
    and finite (NaN and infinity included) or not a whole number of tokens."""
    for name, value, whole in (
        ("tokens_per_day", tokens_per_day, True),
        ("tokens_per_month", tokens_per_month, True),
        ("joules_per_day", joules_per_day, False),
    ):
        if value is None:
            continue
        if not (math.isfinite(value) and 0 < value <= MAX_BUDGET):  # NOTE: NaN fails too
            raise BudgetError(f"budget {name} must be positive (at most 2^53), got {value}")
        if whole and value != int(value):
            raise BudgetError(f"budget {name} must be a whole number of tokens, got {value}")
    return Budget(
        None if tokens_per_day is None else int(tokens_per_day),
        None if tokens_per_month is None else int(tokens_per_month),
        None if joules_per_day is None else float(joules_per_day),
    )


def key_scope(key_id: str) -> str:
    """The scope of an API key's own budget and usage (its tenant's is the tenant's name)."""
    return "@" + key_id


def parse_budget(doc: Any) -> Budget:
    """A stored budget, every figure checked (it comes from etcd)."""
    d = records.obj(doc if doc is not None else {}, "budget")
    day = records.integer(d, "tokens_per_day", 0)
    month = records.integer(d, "tokens_per_month", 0)
    joules = records.number(d, "joules_per_day", None, 0.0, MAX_BUDGET)
    return Budget(day or None, month or None, joules or None)


@dataclass(frozen=True, slots=True)
class TenantRecord:
    tenant: str
    budget: Budget = Budget()
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "budget": self.budget.to_json(), "note": self.note}


def parse_tenant(doc: Any, name: str | None = None) -> TenantRecord:
    """A stored tenant record; `name`: the tenant its key names (the two must agree)."""
    try:
        d = records.obj(doc, "tenant record")
        tenant = records.text(d, "tenant", required=True)
        if not TENANT_NAME.match(tenant):
            raise records.RecordError("'tenant' must be 1-64 of [A-Za-z0-9._-]")
        if name is not None and tenant != name:
            raise records.RecordError(f"'tenant' is {tenant!r} in the record of {name!r}")
        return TenantRecord(tenant, parse_budget(d.get("budget")), records.text(d, "note"))
    except records.RecordError as exc:
        raise BudgetError(f"tenant record: {exc}") from None


# ---- periods -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Period:
    """The UTC day and month a time falls in, and when each ends."""

    day: str  # 2026-12-06
    month: str  # 2026-12
    day_ends_unix: float
    month_ends_unix: float


def period(now_unix: float) -> Period:
    t = dt.datetime.fromtimestamp(now_unix, dt.UTC)
    day_start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    next_day = day_start + dt.timedelta(days=1)
    first = day_start.replace(day=1)
    next_month = first.replace(year=first.year + first.month // 12, month=first.month % 12 + 1)
    return Period(
        day_start.strftime("%Y-%m-%d"),
        day_start.strftime("%Y-%m"),
        next_day.timestamp(),
        next_month.timestamp(),
    )


# ---- usage ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Used:
    """A tenant's consumption in the current period."""

    tokens_day: float = 0.0
    tokens_month: float = 0.0
    joules_day: float = 0.0

    def add(self, other: Used) -> None:
        self.tokens_day += other.tokens_day
        self.tokens_month += other.tokens_month
        self.joules_day += other.joules_day

    def as_list(self) -> list[float]:
        return [self.tokens_day, self.tokens_month, self.joules_day]


class UsageEntry(NamedTuple):
    """One writer's count of one tenant, as published at /cognitora/usage/<writer>/<tenant>:
    `[day, tokens today, tokens this month, joules today]` (a NamedTuple and a JSON list:
    every router reads every other's, several thousand a second in a busy fleet)."""

    writer: str
    tenant: str
    day: str  # YYYY-MM-DD; its month is the first 7 characters
    used: Used

    @property
    def key(self) -> str:
        return f"{self.writer}/{self.tenant}"

    @property
    def month(self) -> str:
        return self.day[:7]

    def to_json(self) -> list[Any]:
        return [self.day, *self.used.as_list()]

    def in_period(self, p: Period) -> Used:
        """What counts of it in period `p`: all of it in the same day; the month's tokens
        in another day of the same month; nothing from another month."""
        if self.day == p.day:
            return self.used
        if self.day[:7] != p.month:
            return Used()
        return Used(0.0, self.used.tokens_month, 0.0)


@functools.lru_cache(maxsize=1 << 16)
def usage_key(key: str) -> tuple[str, str]:
    """(writer, tenant) of a usage record's key below /cognitora/usage/; BudgetError if it
    names no writer and tenant (remembered: the same keys come back every second)."""
    writer, _, tenant = key.partition("/")
    if not WRITER_NAME.match(writer) or not SCOPE_NAME.match(tenant):
        raise BudgetError(f"usage record key {key[:80]!r}: want <writer>/<tenant>")
    return writer, tenant


def parse_usage(doc: Any, key: str) -> UsageEntry:
    """A usage record from etcd (its key below /cognitora/usage/ names its writer and
    tenant), every number bounded before it is used."""
    writer, tenant = usage_key(key)
    if type(doc) is not list or len(doc) != 4:
        raise BudgetError("usage record: want [day, tokens today, this month, joules today]")
    day, today, month, joules = doc
    if type(day) is not str or not _DAY.match(day):
        raise BudgetError(f"usage record: the day {day!r:.40} must read YYYY-MM-DD")
    for v in (today, month, joules):  # NOTE: bounded before float(): 10**400 overflows it
        if (type(v) is not int and type(v) is not float) or not 0 <= v <= MAX_BUDGET:
            raise BudgetError(f"usage record: {v!r:.40} is not a count")  # NaN fails too
    return UsageEntry(writer, tenant, day, Used(float(today), float(month), float(joules)))


def total(usage: Iterable[UsageEntry], p: Period) -> dict[str, Used]:
    """Each tenant's usage over every writer's record, in period `p`."""
    out: dict[str, Used] = {}
    for entry in usage:
        out.setdefault(entry.tenant, Used()).add(entry.in_period(p))
    return out


# ---- the decision --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exhausted:
    """A budget that `used` has reached: which, its figure, and when it resets."""

    what: str  # tokens_per_day | tokens_per_month | joules_per_day
    limit: float
    used: float
    resets_unix: float

    def message(self, who: str) -> str:
        """Why a request of `who` (tenant 'acme', key 1f2e3d4c) is refused, and until when."""
        unit = "joules" if self.what.startswith("joules") else "tokens"
        per = self.what.rsplit("_", 1)[1]
        when = dt.datetime.fromtimestamp(self.resets_unix, dt.UTC).strftime("%Y-%m-%d %H:%M")
        return (
            f"{who} has used {self.used:.0f} of its {self.limit:.0f} {unit} per "
            f"{per}; the budget resets at {when} UTC"
        )


def exhausted(b: Budget, used: Used, p: Period) -> Exhausted | None:
    """The budget `used` has reached, the one that resets last first (None: within all)."""
    hit = [
        Exhausted(what, float(limit), spent, resets)
        for what, limit, spent, resets in (
            ("tokens_per_month", b.tokens_per_month, used.tokens_month, p.month_ends_unix),
            ("tokens_per_day", b.tokens_per_day, used.tokens_day, p.day_ends_unix),
            ("joules_per_day", b.joules_per_day, used.joules_day, p.day_ends_unix),
        )
        if limit is not None and spent >= limit
    ]
    return hit[0] if hit else None


def remaining(b: Budget, used: Used) -> dict[str, float]:
    """What is left of each budget set (never below 0)."""
    out = {}
    for what, limit, spent in (
        ("tokens_per_day", b.tokens_per_day, used.tokens_day),
        ("tokens_per_month", b.tokens_per_month, used.tokens_month),
        ("joules_per_day", b.joules_per_day, used.joules_day),
    ):
        if limit is not None:
            out[what] = max(0.0, limit - spent)
    return out
