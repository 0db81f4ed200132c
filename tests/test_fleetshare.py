"""Tenants' shares across routers (#58, cgn_router/fleetshare.py): the rates, who defers to
whom, the waiting records and their bounds, the ledger's part and admission's, as tables."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cgn_core.budgets import UsageEntry, Used
from cgn_core.etcd import EtcdClient
from cgn_router.fleetshare import TAU_S, FleetShare, parse, to_doc, waiting_of
from cgn_router.ledger import Ledger, _write
from cgn_router.routing.admission import Admission, Ticket, Verdict
from cgn_router.settings import BandSettings

FRESH = 3.0


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_rate_is_tokens_over_its_time_constant_and_decays() -> None:
    share = FleetShare()
    share.served("a", 200.0, 0.0)
    assert share.rate("a", 0.0) == pytest.approx(200.0 / TAU_S)
    assert share.rate("a", TAU_S) == pytest.approx(200.0 / TAU_S / math.e)
    share.served("a", 200.0, TAU_S)  # decayed, then added
    assert share.rate("a", TAU_S) == pytest.approx(200.0 / TAU_S * (1 + 1 / math.e))
    for bad in (-5.0, math.nan, math.inf, 0.0):
        share.served("b", bad, 0.0)
    assert share.rate("b", 0.0) == 0.0 and "b" not in share.rates
    share.forget(100 * TAU_S)
    assert share.rates == {}  # decayed to nothing: dropped


@pytest.mark.parametrize(
    ("mine", "theirs", "weights", "age", "defers", "why"),
    [
        (800, 100, (1, 1), 0.0, True, "it had 8x: it waits for the other's head"),
        (100, 800, (1, 1), 0.0, False, "the one that had less never waits"),
        (100, 100, (1, 1), 0.0, False, "equal: nobody waits"),
        (100, 96, (1, 1), 0.0, False, "within the margin: nobody waits (no flapping)"),
        (800, 100, (1, 1), FRESH + 0.1, False, "a stale record holds nobody back"),
        (200, 150, (1, 2), 0.0, True, "its weight 2 makes its 150 a 75, below my 200: I wait"),
        (200, 150, (2, 1), 0.0, False, "my weight 2 makes my 200 a 100, below its 150"),
    ],
)
def test_a_head_waits_only_for_a_tenant_elsewhere_that_had_less_by_weight(
    mine: float, theirs: float, weights: tuple[float, float], age: float, defers: bool, why: str
) -> None:
    share = FleetShare()
    share.served("me", mine, 0.0)
    share.served("them", theirs, 0.0)
    share.put("r2.w0", {("gold", "m"): {"them": weights[1]}}, 0.0)
    assert share.defers("gold", "m", "me", weights[0], age, FRESH) is defers, why


def test_only_the_same_band_and_pool_and_another_tenant_count() -> None:
    share = FleetShare()
    share.served("me", 800, 0.0)
    share.put("r2.w0", {("gold", "m"): {"them": 1.0, "me": 1.0}}, 0.0)
    assert not share.defers("bronze", "m", "me", 1.0, 0.0, FRESH)  # another band
    assert not share.defers("gold", "other", "me", 1.0, 0.0, FRESH)  # another pool
    assert share.defers("gold", "m", "me", 1.0, 0.0, FRESH)  # "them": 0 tokens so far
    share.put("r2.w0", {}, 0.0)  # its queue emptied
    assert not share.defers("gold", "m", "me", 1.0, 0.0, FRESH)


def test_waiting_records_round_trip_and_bad_ones_are_refused_naming_why() -> None:
    waiting = waiting_of(
        [("gold", "m", "a", 1.0), ("gold", "m", "b", 2.0), ("bronze", "n", "a", 1.0)]
    )
    assert parse(to_doc(waiting)) == waiting
    assert to_doc({}) == {"queues": []} and parse({"queues": []}) == {}
    bad: list[tuple[Any, str]] = [
        ([], "expected {queues"),
        ({"queues": [["gold", "m"]]}, "each is [band, pool"),
        ({"queues": [["gold", 7, {}]]}, "each is [band, pool"),
        ({"queues": [["gold", "m", {"a": math.nan}]]}, "a weight in"),
        ({"queues": [["gold", "m", {"a": True}]]}, "a weight in"),
        ({"queues": [["gold", "m", {"a": 1e9}]]}, "a weight in"),
        ({"queues": [["gold", "m", {"x" * 300: 1}]]}, "a tenant is a name"),
        ({"queues": [["gold", "m", {f"t{i}": 1 for i in range(65)}]]}, "at most 64 tenants"),
        ({"queues": [["b", f"p{i}", {}] for i in range(65)]}, "at most 64"),
    ]
    for doc, why in bad:
        with pytest.raises(ValueError, match=why.replace("[", r"\[")):
            parse(doc)


def entry(writer: str, tenant: str, month_tokens: float) -> UsageEntry:
    return UsageEntry(writer, tenant, "2027-01-15", Used(month_tokens, month_tokens, 0.0))


def test_the_ledger_rates_every_writers_growth_and_hears_only_other_routers_waiting() -> None:
    clock = Clock()
    ledger = Ledger("r1.w0", clock)
    ledger.charge("a", 100)  # its own, as requests end
    ledger.charge("@key1", 100)  # a key's own budget scope: no tenant's share
    ledger.put_other(entry("r1.w1", "a", 500))  # first record of a writer: its past, not a rate
    ledger.put_other(entry("r1.w1", "a", 700))  # a sibling worker served 200 since
    ledger.put_other(entry("r2.w0", "b", 50))
    ledger.put_other(entry("r2.w0", "b", 350))  # another router served 300
    assert ledger.share.rate("a", clock.now) == pytest.approx(300 / TAU_S)
    assert ledger.share.rate("b", clock.now) == pytest.approx(300 / TAU_S)
    assert "@key1" not in ledger.share.rates
    ledger.put_waiting("r1.w1", {("gold", "m"): {"x": 1.0}})  # its own router: shared memory
    ledger.put_waiting("r2.w0", {("gold", "m"): {"b": 1.0}})
    assert set(ledger.share.theirs) == {"r2.w0"}
    ledger.delete_waiting("r2.w0")
    assert ledger.share.theirs == {}


async def test_a_worker_publishes_its_waiting_tenants_while_it_has_some_then_deletes_them(
    etcd: EtcdClient, prefix: str
) -> None:
    ledger = Ledger("r1.w0", Clock())
    usage, records = prefix + "usage/", prefix + "waiting/"
    await _write(ledger, etcd, usage, records)
    assert await etcd.get(records + "r1.w0") is None  # nothing waits: nothing written
    waiting = waiting_of([("gold", "m", "a", 1.0)])
    ledger.waiting = lambda: waiting  # the gate's queues, asked at each write
    for _ in range(2):  # renewed every round while it waits (else it goes stale elsewhere)
        before = await etcd.get(records + "r1.w0")
        await _write(ledger, etcd, usage, records)
        kv = await etcd.get(records + "r1.w0")
        assert kv is not None and parse(kv.json()) == waiting
        assert before is None or kv.mod_revision > before.mod_revision
    ledger.waiting = dict  # its queues emptied
    await _write(ledger, etcd, usage, records)
    assert await etcd.get(records + "r1.w0") is None and not ledger.waiting_published


def test_admission_holds_a_head_while_told_to_and_admits_it_once_not() -> None:
    adm = Admission({"gold": BandSettings(priority=1, ceiling=1.0, queue=10, ttl_s=60)})
    adm.capacity["m"] = 4.0
    held = {"a"}
    adm.defer = lambda band, pool, tenant, weight: tenant in held
    a1 = Ticket("gold", "a", "m", 0.0, cost=100)
    assert adm.offer(a1) is Verdict.QUEUED  # room, but another router's tenant had less
    b1 = Ticket("gold", "b", "m", 0.0, cost=100)
    assert adm.offer(b1) is Verdict.QUEUED  # the band has a queue: b waits its turn
    assert adm.dispatch() == [b1]  # b is not held; a is
    assert adm.waiting_heads() == [("gold", "m", "a", 1.0)]
    held.clear()
    assert adm.dispatch() == [a1]
