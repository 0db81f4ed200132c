"""Tenants' budgets (#58): the records, the periods, the ledger's decision, as tables.

The budgets across two real routers, a restart and `cgn-ctl tenants` are in test_auth.py.
"""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest

from cgn_core.budgets import (
    Budget,
    BudgetError,
    TenantRecord,
    UsageEntry,
    Used,
    budget,
    exhausted,
    parse_tenant,
    parse_usage,
    period,
    remaining,
)
from cgn_core.errors import RateLimited
from cgn_core.etcd import EtcdClient
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

    usage = UsageEntry("gw-8080.w0", "acme", "2026-12-06", Used(1, 2, 0.5))
    assert usage.key == "gw-8080.w0/acme" and usage.month == "2026-12"
    assert parse_usage(json.loads(json.dumps(usage.to_json())), usage.key) == usage
    good = usage.to_json()
    for bad, why in [
        (["2026-12-06", 10**400, 0, 0], "is not a count"),
        (["2026-12-06", math.nan, 0, 0], "is not a count"),
        (["2026-12-06", math.inf, 0, 0], "is not a count"),
        (["2026-12-06", -1, 0, 0], "is not a count"),
        (["2026-12-06", True, 0, 0], "is not a count"),
        (["2026-12-06", 1, 2], "want \\[day, tokens today"),
        ({"day": "2026-12-06"}, "want \\[day, tokens today"),
        (["06/12/2026", 1, 2, 3], "must read YYYY-MM-DD"),
    ]:
        with pytest.raises(BudgetError, match=why):
            parse_usage(bad, usage.key)
    for key in ("gw-8080.w0", "gw-8080.w0/a b", "/acme", "gw/../x/acme"):
        with pytest.raises(BudgetError, match="want <writer>/<tenant>"):
            parse_usage(good, key)


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


def entry(writer: str, tenant: str, day: str, used: tuple[float, float, float]) -> UsageEntry:
    return UsageEntry(writer, tenant, day, Used(*used))


def test_the_ledger_counts_every_writer_and_refuses_with_the_reset_time() -> None:
    clock = Clock("2026-12-06T22:00:00")
    ledger = Ledger("gw.w0", clock)
    ledger.set_budgets({"acme": Budget(tokens_per_day=1000), "free": Budget()})
    assert "free" not in ledger.budgets  # an empty budget limits nothing
    ledger.charge("acme", 600)
    ledger.admit("acme")  # 600 of 1000
    ledger.replace_others([
        entry("gw.w1", "acme", "2026-12-06", (400, 400, 0)),
        entry("old.w0", "acme", "2026-12-05", (900, 900, 0)),  # yesterday: its month counts
        entry("older.w0", "acme", "2026-11-30", (9, 9, 0)),  # last month: nothing
        entry("gw.w0", "acme", "2026-12-06", (5, 5, 0)),  # its own: not another's
    ])  # fmt: skip
    assert ledger.used("acme").as_list() == [1000, 1900, 0]
    with pytest.raises(RateLimited) as refused:
        ledger.admit("acme")
    err = refused.value
    assert err.code == "budget_exhausted" and err.retry_after_s == 2 * 3600 + 1
    assert "used 1000 of its 1000 tokens per day" in err.message
    assert "resets at 2026-12-07 00:00 UTC" in err.message
    ledger.admit("other")  # a tenant without a budget is never refused
    assert ledger.past() == ["older.w0/acme"] and ledger.past() == []  # once a month
    ledger.put_other(entry("gw.w1", "acme", "2026-12-06", (300, 300, 0)))  # replaces its last
    ledger.put_other(entry("gw.w2", "beta", "2026-12-06", (50, 50, 0)))
    assert ledger.used("acme").as_list() == [900, 1800, 0]
    assert ledger.used("beta").as_list() == [50, 50, 0]  # no budget: counted when asked
    ledger.delete_other("old.w0", "acme")
    assert ledger.used("acme").as_list() == [900, 900, 0]
    assert [(e.key, e.used.as_list()) for e in ledger.pending()] == [("gw.w0/acme", [600, 600, 0])]
    assert ledger.pending() == []  # nothing changed since
    clock.now = utc("2026-12-07T00:00:01")  # the next day: the day's count starts again
    ledger.put_other(entry("gw.w1", "acme", "2026-12-07", (0, 300, 0)))
    ledger.admit("acme")
    assert ledger.used("acme").as_list() == [0, 900, 0]
    ledger.charge("acme", 10)
    [mine] = ledger.pending()
    assert (mine.day, mine.used.as_list()) == ("2026-12-07", [10, 610, 0])
    ledger.unsent([mine])  # etcd refused it: taken again next time
    assert [e.key for e in ledger.pending()] == ["gw.w0/acme"]
    clock.now = utc("2027-01-01T00:00:00")  # a new month: nothing of December counts
    assert ledger.used("acme").as_list() == [0, 0, 0] and ledger.own == {}
    # every record of December (and the November one no watch has removed here)
    assert set(ledger.past()) == {"gw.w1/acme", "gw.w2/beta", "gw.w0/acme", "older.w0/acme"}


def test_a_writer_takes_its_own_records_back_up_once() -> None:
    clock = Clock("2026-12-06T10:00:00")
    ledger = Ledger("gw.w0", clock)
    ledger.charge("acme", 5)
    mine = [entry("gw.w0", "acme", "2026-12-06", (100, 300, 1.0)),
            entry("gw.w0", "beta", "2026-12-01", (7, 8, 9)),
            entry("gw.w0", "gamma", "2026-11-20", (1, 1, 1))]  # fmt: skip
    ledger.resume(mine)
    ledger.resume(mine)  # a second listing (the watch reconnected) adds nothing
    assert ledger.used("acme").as_list() == [105, 305, 1.0]
    assert ledger.used("beta").as_list() == [0, 8, 0]  # an earlier day: its month counts
    assert ledger.used("gamma").as_list() == [0, 0, 0]
    assert ledger.past() == ["gw.w0/gamma"]  # its own record of a month that is over


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
    usage = [entry("a.w0", "acme", "2026-12-06", (60, 60, 0)),
             entry("b.w0", "acme", "2026-12-06", (50, 70, 0))]  # fmt: skip
    rows = {r["tenant"]: r for r in tenant_rows([k1, k2], tenants, usage, now)}
    acme = rows["acme"]
    assert acme["keys"] == 2 and acme["weights"] == [1.0, 2.0]
    assert acme["kv_share_groups"] == ["acme-public"]
    assert acme["used"]["tokens_today"] == 110 and acme["remaining"] == {"tokens_per_day": 0}
    assert acme["exhausted"]["budget"] == "tokens_per_day"
    assert rows["idle"]["keys"] == 0 and rows["idle"]["exhausted"] is None


def test_a_key_with_a_budget_of_its_own_is_refused_alone() -> None:
    from cgn_core.apikeys import ApiKeyError, create, parse_record

    ledger = Ledger("gw.w0", Clock("2026-12-06T10:00:00"))
    _, capped = create("acme", "gold", budget=budget(100, None, None))
    _, free = create("acme", "gold")
    assert parse_record(json.loads(json.dumps(capped.to_json()))) == capped
    with pytest.raises(ApiKeyError, match="'budget'"):
        parse_record({**capped.to_json(), "budget": {"tokens_per_day": -1}})
    ledger.set_key_budgets({k.id: k.budget for k in (capped, free)})
    ledger.set_budgets({"acme": Budget(tokens_per_month=10**6)})  # the tenant's: keys' stay
    assert set(ledger.budgets) == {"acme", "@" + capped.id}
    observer = LedgerObserver(ledger, lambda eid: None)
    usage = Usage(prompt_tokens=90, completion_tokens=10, cached_tokens=0)
    for key in (capped, free):
        observer.observe(Ended("m", "ok", 200, 1.0, usage, "", "acme", "m/r", key.id))
    with pytest.raises(RateLimited, match=f"key {capped.id} has used 100 of its 100 tokens"):
        ledger.admit("acme", capped.id)
    ledger.admit("acme", free.id)  # the tenant's other key: within the tenant's budget
    assert ledger.used("acme").tokens_day == 200  # both keys count to the tenant
    assert ledger.used("@" + free.id).tokens_day == 0  # a key without a budget: not counted
    ledger.set_key_budgets({})  # the key revoked: its budget goes
    ledger.admit("acme", capped.id)
    entry = UsageEntry("gw.w1", "@" + capped.id, "2026-12-06", Used(1, 1, 0))
    assert parse_usage(entry.to_json(), entry.key) == entry
    with pytest.raises(BudgetError, match="want <writer>/<tenant>"):
        parse_usage(entry.to_json(), "gw.w1/@nothex00")


async def test_a_write_etcd_refuses_is_kept_for_the_next_round_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from cgn_core.etcd import EtcdClient
    from cgn_core.etcd.local import free_port
    from cgn_core.settings import EtcdSettings
    from cgn_router.ledger import _write

    ledger = Ledger("gw.w0", Clock("2026-12-06T10:00:00"))
    ledger.charge("acme", 10)
    away = EtcdSettings(endpoints=(f"127.0.0.1:{free_port()}",), timeout_s=0.5)
    async with EtcdClient(away) as client:  # nothing listens there
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                await _write(ledger, client)
    assert ledger.changed == {"acme"} and ledger.failing  # kept: written once etcd is back
    assert sum("could not publish" in r.getMessage() for r in caplog.records) == 1


async def test_more_changed_tenants_than_one_transaction_holds_are_all_written(
    etcd: EtcdClient, prefix: str
) -> None:
    from cgn_router.ledger import TXN_OPS, _write

    ledger = Ledger("gw.w0", Clock("2026-12-06T10:00:00"))
    for i in range(2 * TXN_OPS + 50):
        ledger.charge(f"t{i}", 1)
    await _write(ledger, etcd, prefix)
    kvs, _ = await etcd.get_prefix(prefix)
    assert len(kvs) == 2 * TXN_OPS + 50 and not ledger.changed
