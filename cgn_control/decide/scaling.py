r"""The autoscaler's decision: how many replicas each pool should have now, and why.

Pure, like placement.py: `Scaler.decide(pools, samples, now, budget)` is a
function of the pools' bounds and policies, the replicas' recent load
samples, the time and what it decided before (its `PoolMemory`); no I/O.
The leader runs it before each reconciler pass (loop.py) and the reconciler
places or removes replicas toward its targets, one per pass, removing the
cheapest replica first; the agent drains a removed replica (no new
requests, those in flight finish) before it stops the engine.

Per pool (a model's replicas; a disaggregated model's prefill and decode
pools separately), from the samples of replicas Ready for at least
`warmup_s` (a loading or cold replica's figures are not its load), with any
non-finite or negative figure skipped:

    demand    = Σ (running + waiting), averaged over `window_s`   requests at the replicas
    capacity  = the most a replica ran while requests waited on two passes running
                (learned, never configured; one pass's queue is often a prefill step)
    up        = ceil(demand / (capacity × utilization))   fewest replicas that carry it
    down      = ceil(demand / (capacity × utilization × (1 - hysteresis)))
    recommend = up if up > current; down if down < current; else current
                (an SLO breach, ttft p90 above `slo.ttft_p90_ms`: at least current + 1;
                 no demand: `min`; nothing learned yet and nothing waiting: current)

then clamped to [min, max], and acted on: up at once (at most `max_step_up`
replicas a step, `up_cooldown_s` apart), down only to the largest
recommendation of the last `stabilization_s` and `down_cooldown_s` after
any change. Scale-ups across pools share the cluster's `budget` (replicas),
the most pressed pool first; a decision never exceeds it.

    load ▲          ┌── up at once ──┐
         │    ______│                │________   hold: between up and down
         │___/                               \______   down: after the window
         └──────────────────────────────────────────▶ time
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cgn_core.errors import ConfigError

Direction = Literal["up", "down", "hold"]


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """A catalog entry's `scaling:` block (documented in docs/control-plane.md)."""

    enabled: bool = True  # with max > min; `false`: the pool stays at min
    utilization: float = 0.8  # of a replica's learned capacity, the load a step aims at
    hysteresis: float = 0.25  # down only when the smaller fleet would sit this far below
    warmup_s: float = 30.0  # a replica Ready for less than this is not sampled
    window_s: float = 10.0  # demand is the mean of this many seconds of samples
    up_cooldown_s: float = 15.0  # between two steps up
    down_cooldown_s: float = 60.0  # after any change, before a step down
    stabilization_s: float = 120.0  # a step down goes to the largest recommendation of this
    max_step_up: int = 4  # replicas one step up may add
    ttft_p90_ms: float | None = None  # the SLO (`slo:` block); None: none
    itl_p90_ms: float | None = None

    def check(self, where: str = "scaling") -> None:
        if not 0.05 <= self.utilization <= 1.0:
            raise ConfigError(f"{where}.utilization must be in [0.05, 1], got {self.utilization}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ConfigError(f"{where}.hysteresis must be in [0, 1), got {self.hysteresis}")
        for name in ("warmup_s", "window_s", "up_cooldown_s", "down_cooldown_s", "stabilization_s"):
            value = getattr(self, name)
            if not 0.0 <= value <= 86400.0:
                raise ConfigError(f"{where}.{name} must be in [0, 86400], got {value}")
        if not 1 <= self.max_step_up <= 1000:
            raise ConfigError(f"{where}.max_step_up must be in [1, 1000], got {self.max_step_up}")
        for name in ("ttft_p90_ms", "itl_p90_ms"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 3.6e6:
                raise ConfigError(f"slo.{name} must be in (0, 3600000], got {value}")


@dataclass(frozen=True, slots=True)
class Sample:
    """One replica's load as the router last saw it (the leader is a router)."""

    pool: str  # the pool label (cgn_control.decide.catalog.pool_label)
    replica: str
    running: float
    waiting: float
    ready_for_s: float  # how long it has been routable; samples under warmup_s are ignored

    @property
    def usable(self) -> bool:
        figures = (self.running, self.waiting, self.ready_for_s)
        return all(math.isfinite(x) and x >= 0 for x in figures)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as a router sees it: what the router hands the leader's loop."""

    model: str
    role: str  # the endpoint's role: both | prefill | decode
    replica: str
    running: float  # the engine's own figures (scraped), or the router's in flight
    waiting: float
    in_flight: int  # this router's requests on it now (what a removal would have to drain)
    ready_for_s: float
    cached_blocks: int = 0  # KV blocks the router knows it holds (prefix hits a removal loses)


@dataclass(frozen=True, slots=True)
class Signals:
    """Everything the scaler reads, from the router the leader runs in."""

    replicas: tuple[ReplicaLoad, ...] = ()
    ttft_p90_s: Mapping[str, float] = field(default_factory=dict)  # per model, over a window
    itl_p90_s: Mapping[str, float] = field(default_factory=dict)
    waiting_at_router: Mapping[str, int] = field(default_factory=dict)  # per model, no replica


@dataclass(frozen=True, slots=True)
class Pool:
    """What the scaler is told of one pool: its bounds, policy and current replicas."""

    label: str
    min: int
    max: int
    current: int  # replicas placed and not draining
    policy: ScalingPolicy = ScalingPolicy()
    ttft_p90_s: float | None = None  # the router's own measure over the window; None: none
    itl_p90_s: float | None = None
    waiting_at_router: int = 0  # requests held for a pool that has no replica (min 0)


@dataclass(frozen=True, slots=True)
class Decision:
    label: str
    current: int
    desired: int
    direction: Direction
    reason: str
    demand: float
    capacity: float | None
    next_step_unix: float | None = None  # when a step the other way may happen, if waiting

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.label,
            "current": self.current,
            "desired": self.desired,
            "direction": self.direction,
            "reason": self.reason,
            "demand": round(self.demand, 3),
            "capacity": self.capacity,
        }


@dataclass
class PoolMemory:
    """What the scaler remembers of a pool between passes (lost on a leader hand-over: the
    next leader starts from the replicas it finds, and learns capacity again)."""

    since: float  # when this scaler first saw the pool
    desired: int | None = None
    capacity: float | None = None
    last_up: float = -math.inf
    last_down: float = -math.inf
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    demands: deque[tuple[float, float]] = field(default_factory=deque)  # (time, demand)
    queued: set[str] = field(default_factory=set)  # replicas with requests waiting, last pass


@dataclass
class Scaler:
    memory: dict[str, PoolMemory] = field(default_factory=dict)

    def decide(
        self,
        pools: Sequence[Pool],
        samples: Sequence[Sample],
        now: float,
        budget: int | None = None,
    ) -> dict[str, Decision]:
        """Each pool's target; the sum of targets stays within `budget` where one is set
        (pools already above it are not cut, only not grown)."""
        by_pool: dict[str, list[Sample]] = {}
        for s in samples:
            by_pool.setdefault(s.pool, []).append(s)
        wanted = {p.label: self._one(p, by_pool.get(p.label, ()), now) for p in pools}
        if budget is None:
            return self._commit(wanted, now)
        held = sum(min(d.desired, d.current) for d in wanted.values())
        room = max(0, budget - held)
        # NOTE: the most pressed pool first: demand per replica it has
        order = sorted(
            (d for d in wanted.values() if d.desired > d.current),
            key=lambda d: -d.demand / max(d.current, 1),
        )
        for d in order:
            grant = min(d.desired - d.current, room)
            room -= grant
            if grant < d.desired - d.current:
                why = f"{d.reason}; the cluster budget of {budget} replicas allows {grant} more"
                direction: Direction = "up" if grant else "hold"
                wanted[d.label] = _with(d, d.current + grant, direction, why)
        return self._commit(wanted, now)

    def _commit(self, wanted: dict[str, Decision], now: float) -> dict[str, Decision]:
        for label, d in wanted.items():
            mem = self.memory[label]
            if d.direction == "up":
                mem.last_up = now
            elif d.direction == "down":
                mem.last_down = now
            mem.desired = d.desired
        for gone in set(self.memory) - set(wanted):
            del self.memory[gone]
        return wanted

    def _one(self, pool: Pool, samples: Sequence[Sample], now: float) -> Decision:
        p = pool.policy
        mem = self.memory.setdefault(pool.label, PoolMemory(since=now))
        current = pool.current if mem.desired is None else mem.desired
        lo, hi = pool.min, pool.max

        def decided(target: int, why: str, demand: float = 0.0) -> Decision:
            return _decision(pool, current, target, why, demand, mem.capacity)

        if not p.enabled:
            return decided(lo, "scaling off: min replicas")
        if lo == hi:
            return decided(lo, "fixed size")
        if not lo <= current <= hi:  # the bounds changed: inside them at once
            return decided(min(max(current, lo), hi), f"outside min {lo} .. max {hi}")
        usable = [s for s in samples if s.usable and s.ready_for_s >= p.warmup_s]
        queued = {s.replica for s in usable if s.waiting > 0 and s.running >= 1}
        for s in usable:  # requests waiting on two passes running: all it can run, its capacity
            if s.replica in queued and s.replica in mem.queued:
                mem.capacity = max(mem.capacity or 0.0, s.running)
        mem.queued = queued  # NOTE: one pass's queue is often a prompt's prefill step, not a limit
        now_demand = sum(s.running + s.waiting for s in usable) + pool.waiting_at_router
        mem.demands.append((now, now_demand))
        while mem.demands[0][0] < now - p.window_s:
            mem.demands.popleft()
        demand = sum(d for _, d in mem.demands) / len(mem.demands)  # the window's mean
        rec, why = self._recommend(pool, demand, current, mem.capacity)
        rec = min(max(rec, lo), hi)
        mem.recommendations.append((now, rec))
        while mem.recommendations[0][0] < now - p.stabilization_s:
            mem.recommendations.popleft()
        if rec > current:
            wait = mem.last_up + p.up_cooldown_s - now
            if wait > 0:
                return decided(current, f"{why}; up again in {wait:.0f} s", demand)
            return decided(min(rec, current + p.max_step_up), why, demand)
        stable = max(r for _, r in mem.recommendations)  # the window's largest
        if stable >= current:
            held = why if rec == current else f"{why}; held for the {p.stabilization_s:g} s window"
            return decided(current, held, demand)
        wait = max(mem.last_up, mem.last_down) + p.down_cooldown_s - now
        if wait > 0:
            return decided(current, f"{why}; down after the cooldown, in {wait:.0f} s", demand)
        watched = now - mem.since
        if watched < p.stabilization_s:  # a new leader has not seen a whole window yet
            return decided(current, f"{why}; watched {watched:.0f} s of the window", demand)
        return decided(stable, why, demand)

    @staticmethod
    def _recommend(
        pool: Pool,
        demand: float,
        current: int,
        capacity: float | None,
    ) -> tuple[int, str]:
        p = pool.policy
        if demand <= 0 and pool.waiting_at_router == 0:
            return pool.min, "no requests: min replicas"
        slo = _slo_breach(pool)
        if capacity is None:
            if slo:
                return current + 1, slo
            if pool.waiting_at_router and current == 0:
                return 1, "requests wait for a pool with no replica"
            return current, "capacity not learned yet (no replica has had requests waiting)"
        up = math.ceil(demand / (capacity * p.utilization))
        down = math.ceil(demand / (capacity * p.utilization * (1 - p.hysteresis)))
        fig = f"demand {demand:g} at capacity {capacity:g} per replica"
        if slo:
            return max(up, current + 1), f"{slo}; {fig}"
        if up > current:
            return up, f"{fig}: {up} replicas at {p.utilization:.0%}"
        if down < current:
            return down, f"{fig}: {down} replicas carry it with {p.hysteresis:.0%} headroom"
        return current, f"{fig}: within the band"


def _slo_breach(pool: Pool) -> str:
    p = pool.policy
    for name, seen, slo in (
        ("TTFT", pool.ttft_p90_s, p.ttft_p90_ms),
        ("ITL", pool.itl_p90_s, p.itl_p90_ms),
    ):
        if slo is not None and seen is not None and math.isfinite(seen) and seen * 1e3 > slo:
            return f"{name} p90 {seen * 1e3:.0f} ms over the SLO of {slo:g} ms"
    return ""


def _decision(
    pool: Pool, current: int, target: int, why: str, demand: float, capacity: float | None
) -> Decision:
    direction: Direction = "up" if target > current else "down" if target < current else "hold"
    return Decision(pool.label, current, target, direction, why, demand, capacity)


def _with(d: Decision, target: int, direction: Direction, why: str) -> Decision:
    return Decision(d.label, d.current, target, direction, why, d.demand, d.capacity)
