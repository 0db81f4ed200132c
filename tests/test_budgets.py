"""Tenants' budgets (#58): the records, the periods, the ledger's decision, as tables.

The budgets across two real routers, a restart and `cgn-ctl tenants` are in test_auth.py.
"""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest

from cgn_core.budgets import (
    MAX_TENANTS_PER_RECORD,
    Budget,
    BudgetError,
    TenantRecord,
    UsageRecord,
    Used,
    budget,
    exhausted,
    parse_tenant,
    parse_usage,
    period,
    remaining,
)
from cgn_core.errors import RateLimited
from cgn_ctl.tenants_cmd import tenant_rows
from cgn_router.ledger import Ledger, LedgerObserver, writer_name
from cgn_router.routing.lifecycle import Ended
from cgn_router.settings import BudgetSettings
from cgn_router.types import Usage


def utc(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


class Clock:
    def __init__(self, at: str):
        self.now = utc(at)

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("figures", "names"),
    [
        ((-1, None, None), "tokens_per_day must be positive"),
        ((None, 0, None), "tokens_per_month must be positive"),
        ((None, None, math.nan), "joules_per_day must be positive"),
        ((math.inf, None, None), "tokens_per_day must be positive"),
        ((2.5, None, None), "tokens_per_day must be a whole number"),
        ((None, 2.0**60, None), "tokens_per_month must be positive"),
    ],
)
def test_a_budget_a_person_types_is_refused_naming_the_figure(
    figures: tuple[float | None, float | None, float | None], names: str
) -> None:
    with pytest.raises(BudgetError, match=names):
        budget(*figures)


def test_records_round_trip_and_a_bad_one_names_its_field() -> None:
    record = TenantRecord("acme", budget(1000, 20000, 5.5), "pilot")
    assert parse_tenant(json.loads(json.dumps(record.to_json())), "acme") == record
    assert parse_tenant({"tenant": "acme"}).budget.empty
    bad = [
        ({"tenant": "acme", "budget": {"tokens_per_day": 10**400}}, "tokens_per_day"),
        ({"tenant": "acme", "budget": {"tokens_per_day": -5}}, "tokens_per_day"),
        ({"tenant": "acme", "budget": {"joules_per_day": "lots"}}, "joules_per_day"),
        ({"tenant": "acme", "budget": [1, 2]}, "budget"),
        ({"tenant": "../x"}, "'tenant'"),
    ]
    for doc, field in bad:
        with pytest.raises(BudgetError, match=field):
            parse_tenant(doc)
    with pytest.raises(BudgetError, match="in the record of 'other'"):
        parse_tenant({"tenant": "acme"}, "other")

    usage = UsageRecord("gw-8080.w0", "2026-12-06", "2026-12", 1.5, {"acme": Used(1, 2, 0.5)})
    assert parse_usage(json.loads(json.dumps(usage.to_json())), "gw-8080.w0") == usage
    good = usage.to_json()
    for change, why in [
        ({"tenants": {"acme": [10**400, 0, 0]}}, "is not a count"),
        ({"tenants": {"acme": [math.nan, 0, 0]}}, "is not a count"),
        ({"tenants": {"acme": [-1, 0, 0]}}, "is not a count"),
        ({"tenants": {"acme": [1, 2]}}, "want \\[tokens today"),
        ({"tenants": {"a b": [1, 2, 3]}}, "not a tenant name"),
        ({"day": "2026-11-30"}, "'day' and 'month'"),
        ({"writer": "other.w0"}, "not this record's"),
        ({"tenants": {f"t{i}": [0, 0, 0] for i in range(MAX_TENANTS_PER_RECORD + 1)}}, "more"),
    ]:
        with pytest.raises(BudgetError, match=why):
            parse_usage({**good, **change}, "gw-8080.w0")


@pytest.mark.parametrize(
    ("at", "day", "month", "day_ends", "month_ends"),
    [
        ("2026-12-06T10:00:00", "2026-12-06", "2026-12", "2026-12-07", "2027-01-01"),
        ("2026-12-31T23:59:59", "2026-12-31", "2026-12", "2027-01-01", "2027-01-01"),
        ("2028-02-28T12:00:00", "2028-02-28", "2028-02", "2028-02-29", "2028-03-01"),
    ],
)
def test_periods_are_utc_days_and_months(
    at: str, day: str, month: str, day_ends: str, month_ends: str
) -> None:
    p = period(utc(at))
    assert (p.day, p.month) == (day, month)
    assert p.day_ends_unix == utc(day_ends + "T00:00:00")
    assert p.month_ends_unix == utc(month_ends + "T00:00:00")


def test_the_budget_that_resets_last_is_the_one_reported() -> None:
    b = Budget(tokens_per_day=100, tokens_per_month=1000, joules_per_day=2.0)
    p = period(utc("2026-12-06T10:00:00"))
    assert exhausted(b, Used(99, 999, 1.9), p) is None
    day = exhausted(b, Used(100, 500, 0.0), p)
    assert day is not None and (day.what, day.resets_unix) == ("tokens_per_day", p.day_ends_unix)
    month = exhausted(b, Used(100, 1000, 3.0), p)
    assert month is not None and month.what == "tokens_per_month"
    assert exhausted(b, Used(0, 0, 2.0), p).what == "joules_per_day"  # type: ignore[union-attr]
    assert remaining(b, Used(30, 1200, 0.5)) == {
        "tokens_per_day": 70,
        "tokens_per_month": 0,
        "joules_per_day": 1.5,
    }


def test_the_ledger_counts_every_writer_and_refuses_with_the_reset_time() -> None:
    clock = Clock("2026-12-06T22:00:00")
    ledger = Ledger("gw.w0", clock)
    ledger.set_budgets({"acme": Budget(tokens_per_day=1000), "free": Budget()})
    assert "free" not in ledger.budgets  # an empty budget limits nothing
    ledger.charge("acme", 600)
    ledger.admit("acme")  # 600 of 1000
    theirs = UsageRecord("gw.w1", "2026-12-06", "2026-12", clock(), {"acme": Used(400, 400, 0)})
    stale = UsageRecord("old.w0", "2026-12-05", "2026-12", clock(), {"acme": Used(900, 900, 0)})
    gone = UsageRecord("older.w0", "2026-11-30", "2026-11", clock(), {"acme": Used(9, 9, 0)})
    ledger.replace_others({r.writer: r for r in (theirs, stale, gone)})
    assert ledger.used("acme").as_list() == [1000, 1900, 0]  # yesterday counts in the month
    with pytest.raises(RateLimited) as refused:
        ledger.admit("acme")
    err = refused.value
    assert err.code == "budget_exhausted" and err.retry_after_s == 2 * 3600 + 1
    assert "used 1000 of its 1000 tokens per day" in err.message
    assert "resets at 2026-12-07 00:00 UTC" in err.message
    ledger.admit("other")  # a tenant without a budget is never refused
    assert ledger.past() == ["older.w0"]
    clock.now = utc("2026-12-07T00:00:01")  # the next day: the day's count starts again
    theirs = UsageRecord("gw.w1", "2026-12-07", "2026-12", clock(), {"acme": Used(0, 400, 0)})
    ledger.put_other(theirs)
    ledger.admit("acme")
    assert ledger.used("acme").as_list() == [0, 1900, 0]
    assert ledger.record().to_json()["tenants"] == {"acme": [0, 600, 0]}
    clock.now = utc("2027-01-01T00:00:00")  # a new month: nothing of December counts
    assert ledger.used("acme").as_list() == [0, 0, 0] and ledger.own == {}


def test_a_writer_takes_its_own_record_back_up_once() -> None:
    clock = Clock("2026-12-06T10:00:00")
    ledger = Ledger("gw.w0", clock)
    ledger.charge("acme", 5)
    mine = UsageRecord("gw.w0", "2026-12-06", "2026-12", clock(), {"acme": Used(100, 300, 1.0)})
    ledger.resume(mine)
    ledger.resume(mine)  # a second listing (the watch reconnected) adds nothing
    ledger.replace_others({"gw.w0": mine})  # its own record is not another writer's
    assert ledger.used("acme").as_list() == [105, 305, 1.0]
    yesterday = UsageRecord("gw.w0", "2026-12-05", "2026-12", clock(), {"acme": Used(7, 8, 9)})
    fresh = Ledger("gw.w0", clock)
    fresh.resume(yesterday)
    assert fresh.used("acme").as_list() == [0, 8, 0]


def test_requests_are_charged_when_they_end_with_joules_where_measured() -> None:
    ledger = Ledger("gw.w0", Clock("2026-12-06T10:00:00"))
    efficiency = {"m/fast": 4.0}  # output tokens per joule
    observer = LedgerObserver(ledger, efficiency.get)
    usage = Usage(prompt_tokens=30, completion_tokens=10, cached_tokens=0)
    observer.observe(Ended("m", "ok", 200, 1.0, usage, "", "acme", "m/fast"))
    observer.observe(Ended("m", "ok", 200, 1.0, usage, "", "acme", "m/unmeasured"))
    observer.observe(Ended("m", "upstream_error", 502, 1.0, None, "x", "acme", ""))
    observer.observe(Ended("m", "", 401, 0.0, None, "missing_key", "", ""))
    assert ledger.used("acme").as_list() == [80, 80, 2.5]


def test_the_metrics_show_the_tenants_nearest_to_running_out_first() -> None:
    ledger = Ledger("gw.w0", Clock("2026-12-06T10:00:00"))
    ledger.set_budgets(
        {"a": Budget(tokens_per_day=100), "b": Budget(tokens_per_day=1000, joules_per_day=10)}
    )
    ledger.charge("a", 10)
    ledger.charge("b", 100, joules=9.5)
    assert ledger.remaining_rows(5) == [
        ("b", "tokens_per_day", 900),
        ("b", "joules_per_day", 0.5),
        ("a", "tokens_per_day", 90),
    ]
    assert [t for t, _, _ in ledger.remaining_rows(1)] == ["b", "b"]


def test_a_writer_is_named_by_the_instance_else_the_host_and_port() -> None:
    assert writer_name(BudgetSettings(instance="gw-1"), 8080, 3) == "gw-1.w3"
    named = writer_name(BudgetSettings(), 8080, 0)
    assert named.endswith("-8080.w0")
    assert "pid" in writer_name(BudgetSettings(), 0, 0)  # a port the system picks names nothing


def test_ctl_lists_each_tenants_usage_against_its_budget() -> None:
    from cgn_core.apikeys import create

    now = utc("2026-12-06T10:00:00")
    _, k1 = create("acme", "gold", weight=2.0, kv_share_group="acme-public")
    _, k2 = create("acme", "gold")
    tenants = [TenantRecord("acme", Budget(tokens_per_day=100)), TenantRecord("idle")]
    usage = [
        UsageRecord("a.w0", "2026-12-06", "2026-12", now, {"acme": Used(60, 60, 0)}),
        UsageRecord("b.w0", "2026-12-06", "2026-12", now, {"acme": Used(50, 70, 0)}),
    ]
    rows = {r["tenant"]: r for r in tenant_rows([k1, k2], tenants, usage, now)}
    acme = rows["acme"]
    assert acme["keys"] == 2 and acme["weights"] == [1.0, 2.0]
    assert acme["kv_share_groups"] == ["acme-public"]
    assert acme["used"]["tokens_today"] == 110 and acme["remaining"] == {"tokens_per_day": 0}
    assert acme["exhausted"]["budget"] == "tokens_per_day"
    assert rows["idle"]["keys"] == 0 and rows["idle"]["exhausted"] is None
