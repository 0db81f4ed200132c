"""The autoscaler's decision (cgn_control/decide/scaling.py) as tables, plus a property: whatever the
load does, a target stays within min..max and the budget, and changes at most once a cooldown."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_control.decide.scaling import Pool, Sample, Scaler, ScalingPolicy

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
