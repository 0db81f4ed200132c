"""The autoscaler's decision (cgn_control/decide/scaling.py) as tables, plus a property: whatever the
load does, a target stays within min..max and the budget, and changes at most once a cooldown."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_control.decide.scaling import Pool, ReplicaSpeed, Sample, Scaler, ScalingPolicy

# demand as sampled (window_s 0): the tables below are about the rules, not the averaging
POLICY = ScalingPolicy(
    warmup_s=10, window_s=0, up_cooldown_s=15, down_cooldown_s=60, stabilization_s=120
)


def samples(pool: str, loads: list[tuple[float, float]], ready_for_s: float = 600) -> list[Sample]:
    """One sample per replica: (running, waiting)."""
    return [Sample(pool, f"r{i}", r, w, ready_for_s) for i, (r, w) in enumerate(loads)]


def pool(current: int, lo: int = 1, hi: int = 8, **kw: object) -> Pool:
    return Pool("m", lo, hi, current, POLICY, **kw)  # type: ignore[arg-type]


def twice(s: Scaler, pools: list[Pool], load: list[Sample], now: float, **kw: object) -> dict:
    """A pass half a second before, then the decision: a capacity is learned only from a
    queue that lasted two passes."""
    s.decide(pools, load, now=now - 0.5, **kw)  # type: ignore[arg-type]
    return s.decide(pools, load, now=now, **kw)  # type: ignore[arg-type]


def test_a_step_up_in_load_adds_several_replicas_at_once() -> None:
    s = Scaler()
    d = twice(s, [pool(2)], samples("m", [(8, 12), (8, 12)]), now=0)["m"]
    # capacity 8 learned (requests waited); demand 40 / (8 x 0.8) = 7, at most 4 a step
    assert (d.direction, d.desired, d.capacity) == ("up", 6, 8)
    again = s.decide([pool(6)], samples("m", [(8, 12)] * 2), now=5)["m"]
    assert again.desired == 6 and "up again in 10 s" in again.reason  # the up cooldown
    assert s.decide([pool(6)], samples("m", [(8, 12)] * 2), now=15)["m"].desired == 7


def test_zero_traffic_returns_to_min_within_the_stabilization_window() -> None:
    s = Scaler()
    twice(s, [pool(2)], samples("m", [(8, 4), (8, 4)]), now=0)  # learns capacity 8, goes to 4
    for t in range(10, 130, 10):  # traffic stops at t=10: held for the 120 s window
        d = s.decide([pool(4)], samples("m", [(0, 0)] * 4), now=t)["m"]
        assert d.desired == 4, (t, d.reason)
    d = s.decide([pool(4)], samples("m", [(0, 0)] * 4), now=131)["m"]
    assert (d.direction, d.desired) == ("down", 1), d.reason


def test_a_steady_load_at_a_boundary_does_not_oscillate() -> None:
    s = Scaler()
    twice(s, [pool(3)], samples("m", [(8, 1), (8, 1), (8, 1)]), now=0)  # capacity 8
    targets = []
    for t in range(1, 2000, 7):  # demand wobbles around 3 replicas' worth (19.2)
        demand = 19.2 + (1.5 if t % 2 else -1.5)
        current = targets[-1] if targets else s.memory["m"].desired or 3
        per = demand / current
        targets.append(
            s.decide([pool(current)], samples("m", [(per, 0)] * current), now=t)["m"].desired
        )
    changes = sum(a != b for a, b in itertools.pairwise(targets))
    assert changes <= 1, targets[:40]


def test_samples_of_loading_or_cold_replicas_do_not_cause_over_scaling() -> None:
    s = Scaler()
    twice(s, [pool(2)], samples("m", [(8, 1), (8, 1)]), now=0)  # capacity 8, demand 18 -> 3
    warm = samples("m", [(6, 0), (6, 0), (6, 0)])
    cold = [Sample("m", "new", 0, 500, ready_for_s=3)]  # its start-up queue, not load
    d = s.decide([pool(3)], [*warm, *cold], now=100)["m"]
    assert d.desired == 3, d.reason


def test_poison_figures_are_skipped_never_acted_on() -> None:
    s = Scaler()
    twice(s, [pool(2)], samples("m", [(8, 1), (8, 1)]), now=0)
    poison = [Sample("m", "x", math.nan, 1e9, 600), Sample("m", "y", -5, 1e9, 600),
              Sample("m", "z", math.inf, 0, 600)]  # fmt: skip
    d = s.decide([pool(3)], [*samples("m", [(6, 0)] * 3), *poison], now=100)["m"]
    assert d.desired == 3 and d.demand == 18


def test_max_and_the_budget_are_never_exceeded_across_models() -> None:
    s = Scaler()
    hot = [Pool("a", 1, 3, 1, POLICY), Pool("b", 1, 8, 1, POLICY), Pool("c", 2, 8, 2, POLICY)]
    load = [*samples("a", [(8, 50)]), *samples("b", [(8, 50)]), *samples("c", [(8, 5)] * 2)]
    got = twice(s, hot, load, now=0, budget=8)
    assert got["a"].desired == 3  # its max
    assert sum(d.desired for d in got.values()) <= 8
    assert got["b"].desired == 3 and "budget of 8" in got["b"].reason  # the rest of the room
    assert got["c"].desired == 2  # least pressed: nothing left


def test_pools_scale_independently() -> None:
    s = Scaler()
    prefill, decode = Pool("m (prefill)", 1, 8, 1, POLICY), Pool("m (decode)", 1, 8, 2, POLICY)
    load = [*samples("m (prefill)", [(4, 20)]), *samples("m (decode)", [(3, 0), (3, 0)])]
    got = twice(s, [prefill, decode], load, now=0)
    assert got["m (prefill)"].direction == "up" and got["m (decode)"].direction == "hold"


def test_an_slo_breach_adds_a_replica_even_before_capacity_is_learned() -> None:
    slo = replace(POLICY, ttft_p90_ms=500)
    s = Scaler()
    d = s.decide([Pool("m", 1, 8, 2, slo, ttft_p90_s=1.2)], samples("m", [(3, 0)] * 2), now=0)["m"]
    assert d.desired == 3 and "TTFT p90 1200 ms over the SLO of 500 ms" in d.reason
    ok = s.decide([Pool("m", 1, 8, 3, slo, ttft_p90_s=0.2)], samples("m", [(3, 0)] * 3), now=20)
    assert ok["m"].desired == 3  # no breach, nothing learned, nothing waiting: held


def test_min_zero_starts_a_replica_for_requests_held_at_the_router() -> None:
    s = Scaler()
    idle = s.decide([pool(0, lo=0)], [], now=0)["m"]
    assert idle.desired == 0
    d = s.decide([pool(0, lo=0, waiting_at_router=1)], [], now=1)["m"]
    assert (d.direction, d.desired) == ("up", 1)


def test_disabled_scaling_and_fixed_sizes_and_new_bounds() -> None:
    s = Scaler()
    off = Pool("m", 2, 8, 5, replace(POLICY, enabled=False))
    assert s.decide([off], samples("m", [(8, 50)] * 5), now=0)["m"].desired == 2
    assert Scaler().decide([pool(3, lo=3, hi=3)], [], now=0)["m"].desired == 3
    narrowed = Scaler()
    narrowed.decide([pool(6)], [], now=0)
    assert narrowed.decide([pool(6, hi=4)], [], now=1)["m"].desired == 4  # at once


def test_a_queue_of_one_pass_teaches_nothing_and_demand_is_a_window_mean() -> None:
    """One pass with requests waiting is often a long prompt's prefill step, not a full
    replica: capacity is learned from a queue seen on two passes running. Demand is the mean
    of `window_s`: one busy pass among idle ones does not double the fleet."""
    s = Scaler()
    blip = s.decide([pool(1)], samples("m", [(1, 2)]), now=0)["m"]
    assert blip.capacity is None and blip.desired == 1
    assert s.decide([pool(1)], samples("m", [(1, 0)]), now=0.5)["m"].capacity is None
    windowed = Scaler()
    p = replace(POLICY, window_s=10)
    twice(windowed, [Pool("m", 1, 8, 2, p)], samples("m", [(8, 4)] * 2), now=0)  # capacity 8
    for t in range(1, 10):  # idle for nine passes
        windowed.decide([Pool("m", 1, 8, 4, p)], samples("m", [(0, 0)] * 4), now=100 + t)
    d = windowed.decide([Pool("m", 1, 8, 4, p)], samples("m", [(8, 40)] * 4), now=110)["m"]
    assert d.demand == pytest.approx(192 / 10) and d.desired == 4  # a burst of one pass


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("utilization", 0.0, "utilization must be in"),
        ("hysteresis", 1.0, "hysteresis must be in"),
        ("up_cooldown_s", -1.0, "up_cooldown_s must be in"),
        ("max_step_up", 0, "max_step_up must be in"),
        ("ttft_p90_ms", 0.0, "slo.ttft_p90_ms must be in"),
        ("stabilization_s", math.nan, "stabilization_s must be in"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(field: str, value: float, fragment: str) -> None:
    with pytest.raises(Exception, match=fragment):
        replace(POLICY, **{field: value}).check()


STEPS = st.lists(
    st.tuples(st.floats(0, 40), st.floats(0, 40), st.floats(0.5, 30)),  # running, waiting, dt
    min_size=1,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, lo=st.integers(0, 3), span=st.integers(0, 6), budget=st.integers(1, 12))
def test_targets_stay_in_bounds_and_change_at_most_once_a_cooldown(
    steps: list[tuple[float, float, float]], lo: int, span: int, budget: int
) -> None:
    s, hi, now, current = Scaler(), lo + span, 0.0, lo
    hi = max(hi, 1)
    changes: list[tuple[float, str]] = []
    for running, waiting, dt in steps:
        now += dt
        load = samples("m", [(running, waiting)] * current)
        d = s.decide([Pool("m", lo, hi, current, POLICY)], load, now=now, budget=budget)["m"]
        assert lo <= d.desired <= hi or d.desired <= max(current, lo)
        assert d.desired <= max(budget, current)
        if d.desired != current:
            changes.append((now, d.direction))
            current = d.desired
    for (t0, _), (t1, kind) in itertools.pairwise(changes):
        gap = POLICY.up_cooldown_s if kind == "up" else POLICY.down_cooldown_s
        assert t1 - t0 >= gap - 1e-9, changes


# ---- in tokens per second: each replica at the speed the routers learned of it ----

FAST = ReplicaSpeed(overhead_s=0.05, prefill_s=1e-4, decode_s=0.02, per_batch_s=0.0)
SLOW = ReplicaSpeed(overhead_s=0.5, prefill_s=1e-3, decode_s=0.2, per_batch_s=0.0)  # 1/10
SHAPE = (1000.0, 200.0)  # the answers' mean uncached prompt and output tokens


def timed(pool: str, loads: list[tuple[float, float, ReplicaSpeed | None]]) -> list[Sample]:
    """One sample per replica: (running, waiting, its learned speed)."""
    return [Sample(pool, f"r{i}", r, w, 600, speed) for i, (r, w, speed) in enumerate(loads)]


@pytest.mark.parametrize("loads", [[(8, 12)] * 2, [(8, 1)] * 3, [(6, 1)] * 4, [(8, 30)]], ids=str)
def test_on_an_equal_fleet_tokens_and_requests_agree(loads: list[tuple[float, float]]) -> None:
    by_requests, by_tokens = Scaler(), Scaler()
    n = len(loads)
    got = twice(by_requests, [pool(n)], samples("m", loads), now=0)["m"]
    timed_loads = [(r, w, FAST) for r, w in loads]
    other = twice(by_tokens, [pool(n, shape=SHAPE)], timed("m", timed_loads), now=0)["m"]
    assert (other.unit, got.unit) == ("tokens/s", "requests")
    assert other.desired == got.desired, (got.reason, other.reason)


def test_a_slow_replica_counts_as_what_it_does_not_as_its_queue() -> None:
    """Requests counted alike: a slow replica's pile looks like demand for more replicas,
    and a busy fast one beside an idle slow one like a pool half used. In tokens per
    second it is the other way round."""
    piled = [(4, 0, FAST), (8, 6, SLOW)]  # the fast one has room: requests are not tokens
    busy = [(8, 4, FAST), (1, 0, SLOW)]  # the slow one adds a tenth of a replica
    counted = {
        name: (
            twice(Scaler(), [pool(2)], samples("m", [(r, w) for r, w, _ in loads]), now=0)["m"],
            twice(Scaler(), [pool(2, shape=SHAPE)], timed("m", loads), now=0)["m"],
        )
        for name, loads in (("piled", piled), ("busy", busy))
    }
    by_requests, by_tokens = counted["piled"]
    assert (by_requests.desired, by_tokens.desired) == (3, 2), by_tokens.reason
    by_requests, by_tokens = counted["busy"]
    assert (by_requests.desired, by_tokens.desired) == (3, 4), by_tokens.reason
    assert "tokens/s" in by_tokens.reason and by_tokens.capacity is not None


def test_the_slowest_replicas_are_the_ones_a_step_down_does_without() -> None:
    """Three replicas, two fast and one at a tenth of their speed, lightly loaded: the step
    down keeps the capacity the demand needs, counting the slowest off first."""
    policy = replace(POLICY, stabilization_s=0, down_cooldown_s=0)
    s = Scaler()
    twice(s, [Pool("m", 1, 8, 3, policy, shape=SHAPE)], timed("m", [(8, 1, FAST)] * 3), now=0)
    light = timed("m", [(3, 0, FAST), (3, 0, FAST), (1, 0, SLOW)])
    d = s.decide([Pool("m", 1, 8, 3, policy, shape=SHAPE)], light, now=100)["m"]
    # demand 6.1 fast-request's worth against 8 + 8 + 0.8: without the slow one and one fast
    # one, 8 < 6.1 / (0.8 x 0.75) = 10.2, so one goes: by requests it would be 2 as well, but
    # which goes is the reconciler's (removal_cost: the slowest first)
    assert (d.direction, d.desired) == ("down", 2), d.reason


def test_an_itl_slo_caps_the_batch_a_replica_is_counted_at() -> None:
    """Throughput at the SLO: a replica that slows by 10 ms per output token per request in
    its batch runs at most 3 under a 45 ms ITL SLO, not the 8 it was seen running."""
    batchy = replace(FAST, per_batch_s=0.01)
    loads = [(8, 8, batchy)] * 2
    free = twice(Scaler(), [pool(2, shape=SHAPE)], timed("m", loads), now=0)["m"]
    capped_policy = replace(POLICY, itl_p90_ms=45)
    capped = twice(Scaler(), [Pool("m", 1, 8, 2, capped_policy, shape=SHAPE)],
                   timed("m", loads), now=0)["m"]  # fmt: skip
    assert capped.capacity is not None and free.capacity is not None
    t = batchy.request_s(*SHAPE, 3)
    assert capped.capacity == pytest.approx(3 * sum(SHAPE) / t, rel=1e-3)
    assert capped.desired > free.desired


@pytest.mark.parametrize(
    "speed", [None, ReplicaSpeed(math.nan, 1e-4, 0.02, 0), ReplicaSpeed(0.1, -1, 0.02, 0),
              ReplicaSpeed(0.1, 1e-4, 0.0, 0)], ids=["none", "nan", "negative", "zero-decode"],
)  # fmt: skip
def test_a_replica_with_no_usable_speed_counts_at_the_typical_one(
    speed: ReplicaSpeed | None,
) -> None:
    known = twice(Scaler(), [pool(2, shape=SHAPE)], timed("m", [(8, 4, FAST)] * 2), now=0)["m"]
    loads = [(8, 4, FAST), (8, 4, speed)]
    got = twice(Scaler(), [pool(2, shape=SHAPE)], timed("m", loads), now=0)["m"]
    assert (got.unit, got.desired, got.demand) == ("tokens/s", known.desired, known.demand)


def test_without_a_shape_or_any_learned_speed_it_counts_requests() -> None:
    loads = [(8, 4, FAST)] * 2
    assert twice(Scaler(), [pool(2)], timed("m", loads), now=0)["m"].unit == "requests"
    cold = [(8, 4, None)] * 2
    assert twice(Scaler(), [pool(2, shape=SHAPE)], timed("m", cold), now=0)["m"].unit == (
        "requests"
    )
    for poison in ((math.nan, 10.0), (-1.0, 10.0), (0.0, 0.0)):
        got = twice(Scaler(), [pool(2, shape=poison)], timed("m", loads), now=0)["m"]
        assert got.unit == "requests", poison
    instant = [(8, 4, ReplicaSpeed(0.0, 0.0, 0.02, 0.0))] * 2  # prompts only, costing nothing
    got = twice(Scaler(), [pool(2, shape=(100.0, 0.0))], timed("m", instant), now=0)["m"]
    assert got.unit == "requests" and got.desired == 4  # 24 requests at 8 a replica


def test_the_router_signals_a_speed_once_learned_and_its_answers_shape() -> None:
    """What the leader's router hands the scaler (cgn_router/load_signals.py): a replica's
    speed once fitted from 3 answers (fewer are noise to size a pool by), and the mean
    uncached prompt and output tokens of the model's answers."""
    from cgn_router.load_signals import LEARNED_SAMPLES, LoadObserver, LoadSignals
    from cgn_router.registry import Registry
    from cgn_router.routing.kv_index import PrefixIndex
    from cgn_router.routing.lifecycle import AttemptEnded
    from cgn_router.routing.speed import Sample as Answer
    from cgn_router.sessions import Sessions
    from cgn_router.settings import BreakerSettings
    from cgn_router.types import Endpoint, EndpointId, Usage

    registry = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), 5)
    eid = EndpointId("m/r1")
    registry.upsert(Endpoint(eid, "m", "http://r1"), "etcd")
    load = LoadSignals(registry)
    seen = LoadObserver(load)
    for i in range(LEARNED_SAMPLES):
        (replica,) = load.signals().replicas
        assert replica.speed is None, i
        registry.learn(eid, Answer(200 + 100 * i, 0.1 + 0.05 * i, 20, 0.4, 1), float(i))
        registry.states[eid].speed = None  # read the fit again now, not after SPEED_READ_S
    (replica,) = load.signals().replicas
    assert replica.speed is not None and replica.speed.usable
    for prompt, cached, output in ((1000, 200, 50), (600, 0, 150)):
        usage = Usage(prompt, output, cached)
        seen.observe(AttemptEnded(1, "m", "client", "ok", usage=usage, endpoint=eid))
    seen.observe(AttemptEnded(2, "m", "client", "upstream_error", usage=Usage(9999, 9, 0)))
    assert load.signals().shape == {"m": (700.0, 100.0)}
