"""The admission state machine: ceilings per band, order, tenants' token shares, TTL,
cancellation."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cgn_router.gate import Gate
from cgn_router.metrics import RouterMetrics
from cgn_router.registry import Registry
from cgn_router.routing.admission import Admission, Capacity, Ticket, Verdict
from cgn_router.routing.kv_index import PrefixIndex
from cgn_router.sessions import Sessions
from cgn_router.settings import AdmissionSettings, BandSettings, BreakerSettings
from cgn_router.types import Endpoint, EndpointId
from cgn_router.workers import shared

BANDS = {
    "platinum": BandSettings(priority=0, ceiling=1.5, queue=10, ttl_s=5.0),
    "bronze": BandSettings(priority=2, ceiling=0.5, queue=3, ttl_s=10.0),
}


def adm(capacity: float = 4.0) -> Admission:
    a = Admission(BANDS)
    a.capacity["m"] = capacity
    return a


def t(band: str, tenant: str = "x", now: float = 0.0, pool: str = "m") -> Ticket:
    return Ticket(band, tenant, pool, now)


def test_bands_degrade_from_the_bottom_up() -> None:
    a = adm(capacity=4)
    assert [a.offer(t("bronze")) for _ in range(3)] == [
        Verdict.ADMIT,
        Verdict.ADMIT,
        Verdict.QUEUED,
    ]
    assert a.saturation("m") == 0.5  # bronze stops at its ceiling: 2 of 4 slots
    assert [a.offer(t("platinum")) for _ in range(5)] == [Verdict.ADMIT] * 4 + [Verdict.QUEUED]
    assert a.saturation("m") == 1.5
    assert a.offer(t("platinum", "y")) == Verdict.QUEUED  # a band with waiters admits nobody ahead
    a.release("m")
    assert [x.band for x in a.dispatch()] == ["platinum"]  # platinum before the waiting bronze


def test_kv_usage_counts_as_saturation_and_leases_stop_a_burst() -> None:
    a = adm(capacity=100)
    a.kv_usage["m"] = 0.6
    assert a.offer(t("bronze")) == Verdict.QUEUED  # KV 60% is above bronze's 50%
    b = adm(capacity=10)
    burst = [b.offer(t("bronze", f"t{i}")) for i in range(8)]
    assert burst.count(Verdict.ADMIT) == 5  # counted at admission, before any reaches an engine


def test_tenants_take_turns_and_each_keeps_its_order() -> None:
    a = Admission({"gold": BandSettings(priority=1, ceiling=1.0, queue=100, ttl_s=60)})
    a.capacity["m"] = 1
    assert a.offer(Ticket("gold", "busy", "m", 0)) == Verdict.ADMIT
    heavy = [Ticket("gold", "busy", "m", 0) for _ in range(20)]
    light = [Ticket("gold", "light", "m", 0) for _ in range(2)]
    for x in heavy:
        a.offer(x)
    for x in light:
        a.offer(x)
    served = []
    for _ in range(6):
        a.release("m")
        served += a.dispatch()
    # busy's first request was admitted at once (and charged): light, which had none, first
    assert [x.tenant for x in served] == ["light", "busy", "light", "busy", "busy", "busy"]
    assert [x for x in served if x.tenant == "busy"] == heavy[:4]


def shares(prompts: dict[str, int], weights: dict[str, float], rounds: int = 400,
           output: int = 0, cached: dict[str, int] | None = None) -> dict[str, float]:  # fmt: skip
    """Tokens each tenant was served while all of them kept requests waiting on a pool of
    one slot, as shares of the total (each request: its prompt, then `output` tokens; the
    engine computes only the prompt's uncached ones, `cached` of each tenant's are hits)."""
    cached = cached or {}
    a = Admission({"gold": BandSettings(priority=1, ceiling=1.0, queue=10_000, ttl_s=60)})
    a.capacity["m"] = 1
    got = dict.fromkeys(prompts, 0.0)
    running: Ticket | None = None
    for tenant, size in prompts.items():  # a backlog each: more than the rounds can serve
        for _ in range(rounds):
            x = Ticket("gold", tenant, "m", 0, cost=size, weight=weights.get(tenant, 1.0))
            if a.offer(x) is Verdict.ADMIT:
                running = x  # the first: the slot was free
    for _ in range(rounds):
        assert running is not None
        hit = cached.get(running.tenant, 0)
        got[running.tenant] += running.cost - hit + output
        a.charge("gold", running.tenant, output - hit, running.weight)
        a.release("m")
        (running,) = a.dispatch()
    total = sum(got.values())
    return {tenant: tokens / total for tenant, tokens in got.items()}


@pytest.mark.parametrize(
    ("prompts", "weights", "output", "want"),
    [
        ({"long": 8000, "short": 1000}, {}, 0, {"long": 0.5, "short": 0.5}),  # not 8:1
        ({"long": 8000, "short": 1000}, {}, 500, {"long": 0.5, "short": 0.5}),  # output counts
        ({"a": 1000, "b": 1000}, {"a": 2.0}, 0, {"a": 2 / 3, "b": 1 / 3}),  # weights 2:1
        ({"a": 8000, "b": 1000}, {"b": 2.0}, 100, {"a": 1 / 3, "b": 2 / 3}),
        ({"a": 500, "b": 500, "c": 4000}, {}, 0, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}),
    ],
)
def test_tenants_share_engine_tokens_by_weight_not_requests(
    prompts: dict[str, int], weights: dict[str, float], output: int, want: dict[str, float]
) -> None:
    got = shares(prompts, weights, output=output)
    for tenant, share in want.items():
        assert got[tenant] == pytest.approx(share, rel=0.10), got


def test_prompt_tokens_the_engine_found_cached_are_credited_back() -> None:
    """Engine work is the prompt tokens not cached: a tenant whose 8k prompts are 7k cached
    costs the engine 1k each, as one of fresh 1k prompts, and gets as many requests (without
    the credit it would get an eighth as many)."""
    got = shares({"cached": 8000, "fresh": 1000}, {}, output=0, cached={"cached": 7000})
    assert got["cached"] == pytest.approx(0.5, rel=0.10), got


def test_a_tenant_back_from_idle_starts_at_the_bands_virtual_time() -> None:
    """No credit saved up: a tenant that sent nothing for a while does not then take the
    pool for as long as the others were served."""
    a = Admission({"gold": BandSettings(priority=1, ceiling=1.0, queue=10_000, ttl_s=60)})
    a.capacity["m"] = 1
    for _ in range(50):  # only "early" is served for a while
        a.offer(Ticket("gold", "early", "m", 0, cost=100))
        a.release("m")
        a.dispatch()
    late = [Ticket("gold", "late", "m", 0, cost=100) for _ in range(10)]
    early = [Ticket("gold", "early", "m", 0, cost=100) for _ in range(10)]
    for x, y in zip(late, early, strict=True):
        a.offer(x)
        a.offer(y)
    order = []
    for _ in range(8):
        a.release("m")
        order += [x.tenant for x in a.dispatch()]
    assert order.count("late") <= 5, order  # turns, not 50 requests' worth of catch-up


def test_full_queue_ttl_and_cancellation() -> None:
    a = adm(capacity=2)
    a.offer(t("bronze"))
    queued = [t("bronze", now=1.0) for _ in range(3)]
    assert [a.offer(x) for x in queued] == [Verdict.QUEUED] * 3
    assert a.offer(t("bronze")) == Verdict.QUEUE_FULL
    assert a.cancel(queued[1]) and not a.cancel(queued[1])
    assert a.depth["bronze"] == 2
    assert a.expire(10.9) == [] and a.expire(11.0) == [queued[0], queued[2]]
    assert a.depth["bronze"] == 0 and a.queues["bronze"] == {}
    assert a.offer(t("nobody")) == Verdict.UNKNOWN_BAND


def test_a_saturated_pool_does_not_block_another_pools_waiters() -> None:
    a = adm(capacity=1)
    a.capacity["other"] = 4
    assert a.offer(t("platinum")) == Verdict.ADMIT  # 1 of 1 slot
    assert a.offer(t("platinum")) == Verdict.QUEUED  # 2 of 1 would exceed the 1.5 ceiling
    stuck, free = t("platinum", "a"), t("platinum", "b", pool="other")
    a.offer(stuck)
    a.offer(free)
    assert a.dispatch() == [free]


@pytest.mark.parametrize(
    ("scrapes", "expected"),
    [
        # (running, waiting) per scrape -> learned capacity after the last one (floor 8)
        ([(0, 0)], 8),
        ([(12, 0)], 12),  # grows at once
        ([(12, 0), (3, 2)], 12),  # one scrape with arrivals waiting for a step: no evidence
        ([(12, 0), (3, 2), (4, 1)], 12),
        ([(12, 0), (3, 2), (0, 0), (3, 2), (4, 1)], 12),  # the streak was broken
        ([(12, 0), (9, 2), (10, 3), (10, 1)], 10),  # waiting three scrapes in a row: full at 10
        ([(12, 0), (3, 2), (4, 1), (2, 5)], 8),  # full below the floor: the floor holds
        ([(12, 0), (9, 2), (10, 3), (10, 1), (14, 0)], 14),  # and grows again
        ([(16, 4), (16, 4), (16, 4)], 16),
    ],
)
def test_capacity_shrinks_only_on_sustained_waiting(
    scrapes: list[tuple[int, int]], expected: float
) -> None:
    cap = Capacity(floor=8)
    for i, (running, waiting) in enumerate(scrapes):
        got = cap.observe(running, waiting, scraped_at=float(i))
    assert got == expected


def test_capacity_counts_each_scrape_once() -> None:
    cap = Capacity(floor=2)
    cap.observe(10, 0, 1.0)
    for _ in range(5):  # the gate refreshes faster than the router scrapes
        assert cap.observe(4, 3, 2.0) == 10
    assert cap.observe(4, 3, 3.0) == 10 and cap.observe(4, 3, 4.0) == 4


def test_other_routers_requests_at_the_engines_count_against_the_ceilings() -> None:
    """Two routers in front of one pool: what the engines run beyond this router's own
    requests is the other router's, and fills the same slots."""
    a = adm(capacity=4)
    a.others["m"] = 2.0  # the engines report 2 more than we sent
    assert a.offer(t("bronze")) == Verdict.QUEUED  # 2 of 4 slots taken elsewhere: bronze waits
    assert [a.offer(t("platinum")) for _ in range(5)] == [Verdict.ADMIT] * 4 + [Verdict.QUEUED]
    assert a.saturation("m") == 1.5
    a.others["m"] = 0.0  # the other router's requests finished: the queued platinum goes
    assert [x.band for x in a.dispatch()] == ["platinum"]


def test_the_gate_reads_other_routers_load_from_the_scrapes() -> None:
    from cgn_router.gate import Gate
    from cgn_router.metrics import RouterMetrics
    from cgn_router.registry import Registry
    from cgn_router.routing.kv_index import PrefixIndex
    from cgn_router.sessions import Sessions
    from cgn_router.settings import AdmissionSettings, BreakerSettings
    from cgn_router.types import Endpoint, EndpointId, EngineLoad

    reg = Registry(BreakerSettings(), PrefixIndex(60, 1000, 5), Sessions(60), stale_s=5.0)
    reg.upsert(Endpoint(EndpointId("m/a"), "m", "http://127.0.0.1:1"), "static")
    now = time.monotonic()
    state = reg.states[EndpointId("m/a")]
    state.load = EngineLoad(running=6, waiting=2, kv_usage=0.1, scraped_at=now, own_in_flight=3)
    gate = Gate(AdmissionSettings(default_capacity=8), reg, RouterMetrics())
    gate.refresh()
    assert gate.adm.others == {"m": 5.0}  # 8 at the engine, 3 of them ours
    state.load = EngineLoad(running=2, waiting=0, scraped_at=now + 1, own_in_flight=4)
    gate.refresh()
    assert gate.adm.others == {"m": 0.0}  # ours still in transit: never negative


@contextmanager
def two_workers(capacity: int) -> Iterator[list[Gate]]:
    """Two router workers' admission gates over one shared table, one pool "m" of
    `capacity` slots."""
    fd = shared.create(shared.LOAD, 2)
    tables = [shared.SharedLoad(fd, 2, w) for w in (0, 1)]
    try:
        gates = []
        for table in tables:
            reg = Registry(BreakerSettings(), PrefixIndex(60, 1000, 5), Sessions(60), stale_s=5.0)
            reg.upsert(Endpoint(EndpointId("m/a"), "m", "http://127.0.0.1:1"), "static")
            gate = Gate(AdmissionSettings(default_capacity=capacity), reg, RouterMetrics(), table)
            gate.refresh()
            gates.append(gate)
        yield gates
    finally:
        for table in tables:
            table.close()
        os.close(fd)


async def test_a_routers_workers_hold_one_ceiling_between_scrapes() -> None:
    """Two workers' gates over one shared table: what one admits counts against the other's
    ceiling at once, not from the next scrape (#58: two workers together had admitted past
    the engine's batch); a finished request frees its slot for either."""
    with two_workers(capacity=2) as gates:
        one, two = gates
        assert await one.enter("gold", "a", "m") == 0.0
        assert await one.enter("gold", "a", "m") == 0.0  # the batch of 2 is full
        waiting = asyncio.ensure_future(two.enter("gold", "b", "m"))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the other worker's two count here
        one.leave("m")
        two._tick()  # its next tick: the slot the first freed is free for it
        assert await asyncio.wait_for(waiting, 1.0) >= 0.0
        assert two.adm.saturation("m") == 1.0  # one here, one there


async def test_a_freed_slot_goes_to_the_routers_earliest_head_whichever_worker_holds_it() -> None:
    """#58 across workers: tenant `big` has requests waiting at worker 0 and `small` one at
    worker 1; when big's running request ends at worker 0, worker 0 leaves the slot to
    worker 1's head (small has consumed less: an earlier start), which its next tick admits.
    Without the shared order, the worker that frees a slot refills it from its own queue,
    and a tenant on a worker with few slots waits behind another's whole burst."""
    with two_workers(capacity=1) as gates:
        zero, one = gates
        assert await zero.enter("gold", "big", "m", cost=100) == 0.0  # the one slot
        bigs = [asyncio.ensure_future(zero.enter("gold", "big", "m", cost=100)) for _ in range(2)]
        small = asyncio.ensure_future(one.enter("gold", "small", "m", cost=100))
        await asyncio.sleep(0.01)
        zero.leave("m", ("gold", "big", 0.0, 1.0))  # big's request ends at worker 0
        await asyncio.sleep(0.01)
        assert not any(f.done() for f in bigs)  # worker 0 left the slot to worker 1's head
        one._tick()
        assert await asyncio.wait_for(small, 1.0) >= 0.0
        one.leave("m", ("gold", "small", 0.0, 1.0))
        zero._tick()  # then big's turn again
        await asyncio.sleep(0.01)
        assert sum(f.done() for f in bigs) == 1
        for f in bigs:
            f.cancel()


async def test_one_tenants_requests_on_two_workers_never_wait_for_each_others_tick() -> None:
    """The order across workers is between tenants: worker 1 has a head of tenant `t` waiting
    with an earlier start than worker 0's (worker 0's request just charged t its answer); when
    that request ends, worker 0 gives the slot to its own head of t at once. Leaving it to
    worker 1's next tick at each of one tenant's requests in turn held a router of two workers
    to ~50 requests/s at c=64 where one worker served 2,200 (found by #64's benchmark)."""
    with two_workers(capacity=1) as gates:
        zero, one = gates
        assert await zero.enter("gold", "t", "m", cost=100) == 0.0  # the one slot
        theirs = asyncio.ensure_future(one.enter("gold", "t", "m", cost=100))
        mine = [asyncio.ensure_future(zero.enter("gold", "t", "m", cost=100)) for _ in range(2)]
        await asyncio.sleep(0.01)
        zero.leave("m", ("gold", "t", 50.0, 1.0))  # t's first request ends, its answer charged
        await asyncio.sleep(0.01)
        assert sum(f.done() for f in mine) == 1 and not theirs.done()  # no tick of worker 1
        for f in (*mine, theirs):
            f.cancel()


def test_what_another_router_served_a_tenant_counts_to_its_share_here() -> None:
    """Fairness across routers (#58): the usage ledger tells admission what other routers
    served; a tenant active here is charged it, so the next head is the other tenant's."""
    a = adm(capacity=1)
    assert a.offer(Ticket("platinum", "y", "m", 0.0, cost=100)) == Verdict.ADMIT
    for tenant in ("x", "y"):  # x has had less here: its head would go first
        assert a.offer(Ticket("platinum", tenant, "m", 0.0, cost=100)) == Verdict.QUEUED
    a.release("m")
    assert a.served_elsewhere("x", 1000) == ["platinum"]  # x's traffic on another router
    assert a.served_elsewhere("idle", 1000) == []  # not active here: nothing to charge
    assert [x.tenant for x in a.dispatch()] == ["y"]


def test_the_ledger_tells_what_other_routers_served_not_this_ones_workers() -> None:
    from cgn_core.budgets import UsageEntry, Used
    from cgn_router.ledger import Ledger

    told: list[tuple[str, float]] = []
    ledger = Ledger("gw-8080.w0", elsewhere=lambda tenant, n: told.append((tenant, n)))
    day = ledger.period.day

    def record(writer: str, scope: str, month_tokens: float) -> UsageEntry:
        return UsageEntry(writer, scope, day, Used(month_tokens, month_tokens, 0))

    for month_tokens in (100, 250):
        ledger.put_other(record("gw-8080.w1", "x", month_tokens))  # its own router's worker
        ledger.put_other(record("other-8080.w0", "x", month_tokens))  # another router
        ledger.put_other(record("other-8080.w0", "@1f2e3d4c", month_tokens))  # a key's count
    assert told == [("x", 150)]  # the first record of a writer is its history, not news
