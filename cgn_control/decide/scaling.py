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

Where the routers learned the replicas' speeds (cgn_router/routing/speed.py) and the
pool's answers' shape (P uncached prompt tokens and O output tokens, their means), the
same rules run in tokens per second, so that unequal replicas count as what they do:

    T_i(b)      = overhead_i + prefill_i·P + O·(decode_i + per_batch_i·(b - 1))
                  seconds for one request on replica i in a batch of b
    demand      = Σ_i (running_i + waiting_i)·(P + O) / T_i(max(1, running_i))
    capacity_i  = b_i·(P + O) / T_i(b_i), b_i its own learned batch (else the pool's),
                  fewer where `slo.itl_p90_ms` allows no more (the throughput at its SLO)
    up          = current + ceil((demand / utilization - Σ capacity_i) / typical)
    down        = current - the most replicas, the slowest first, whose removal leaves
                  Σ capacity_i ≥ demand / (utilization × (1 - hysteresis))

A replica whose speed is not learned counts at the median of those learned (`typical`,
also what a new replica is expected to add). On an equal fleet the two agree.

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
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from cgn_core.errors import ConfigError

Direction = Literal["up", "down", "hold"]
Unit = Literal["requests", "tokens/s"]


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
class ReplicaSpeed:
    """A replica's speed as the routers learned it from its answers, in seconds."""

    overhead_s: float
    prefill_s: float  # per uncached prompt token
    decode_s: float  # per output token, alone
    per_batch_s: float  # per output token, per other request in its batch

    def request_s(self, prompt: float, output: float, batch: float) -> float:
        """One request's seconds, `prompt` uncached tokens and `output` tokens, in a batch
        of `batch` (T in the module's formulas)."""
        per_token = self.decode_s + self.per_batch_s * max(0.0, batch - 1)
        return self.overhead_s + self.prefill_s * prompt + output * per_token

    @property
    def usable(self) -> bool:
        figures = (self.overhead_s, self.prefill_s, self.decode_s, self.per_batch_s)
        return all(math.isfinite(x) and 0 <= x <= 3600 for x in figures) and self.decode_s > 0


@dataclass(frozen=True, slots=True)
class Sample:
    """One replica's load as the router last saw it (the leader is a router)."""

    pool: str  # the pool label (cgn_control.decide.catalog.pool_label)
    replica: str
    running: float
    waiting: float
    ready_for_s: float  # how long it has been routable; samples under warmup_s are ignored
    speed: ReplicaSpeed | None = None  # learned from its answers; None: not yet

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
    speed: ReplicaSpeed | None = None  # as the router learned it; None: not yet


@dataclass(frozen=True, slots=True)
class Signals:
    """Everything the scaler reads, from the router the leader runs in."""

    replicas: tuple[ReplicaLoad, ...] = ()
    ttft_p90_s: Mapping[str, float] = field(default_factory=dict)  # per model, over a window
    itl_p90_s: Mapping[str, float] = field(default_factory=dict)
    waiting_at_router: Mapping[str, int] = field(default_factory=dict)  # per model, no replica
    # per model: its answers' mean (uncached prompt tokens, output tokens) over a window
    shape: Mapping[str, tuple[float, float]] = field(default_factory=dict)


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
    shape: tuple[float, float] | None = None  # its answers' mean (prompt, output) tokens


@dataclass(frozen=True, slots=True)
class Decision:
    label: str
    current: int
    desired: int
    direction: Direction
    reason: str
    demand: float
    capacity: float | None  # per replica (the typical one's, in tokens/s)
    next_step_unix: float | None = None  # when a step the other way may happen, if waiting
    unit: Unit = "requests"  # of demand and capacity

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.label,
            "current": self.current,
            "desired": self.desired,
            "direction": self.direction,
            "reason": self.reason,
            "demand": round(self.demand, 3),
            "capacity": None if self.capacity is None else round(self.capacity, 3),
            "unit": self.unit,
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
    token_demands: deque[tuple[float, float]] = field(default_factory=deque)  # tokens/s
    queued: set[str] = field(default_factory=set)  # replicas with requests waiting, last pass
    batch: dict[str, float] = field(default_factory=dict)  # replica -> its own capacity


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

        by_tokens: tuple[float, list[float]] | None = None  # (demand, each one's capacity)

        def decided(target: int, why: str, demand: float = 0.0) -> Decision:
            if by_tokens is None:
                return _decision(pool, current, target, why, demand, mem.capacity)
            d = _decision(pool, current, target, why, by_tokens[0], _median(by_tokens[1]))
            return replace(d, unit="tokens/s")

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
                mem.batch[s.replica] = max(mem.batch.get(s.replica, 0.0), s.running)
        mem.queued = queued  # NOTE: one pass's queue is often a prompt's prefill step, not a limit
        for gone in set(mem.batch) - {s.replica for s in samples}:
            del mem.batch[gone]
        now_demand = sum(s.running + s.waiting for s in usable) + pool.waiting_at_router
        demand = _window_mean(mem.demands, now, now_demand, p.window_s)
        tokens = _in_tokens(pool, usable, mem)
        if tokens is not None:
            by_tokens = (_window_mean(mem.token_demands, now, tokens[0], p.window_s), tokens[1])
            rec, why = self._by_tokens(pool, by_tokens[0], current, by_tokens[1])
            demand = by_tokens[0]
        else:
            mem.token_demands.clear()
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

    @staticmethod
    def _by_tokens(
        pool: Pool, demand: float, current: int, capacities: list[float]
    ) -> tuple[int, str]:
        """`_recommend` in tokens per second, each replica at its own learned capacity."""
        p = pool.policy
        if demand <= 0 and pool.waiting_at_router == 0:
            return pool.min, "no requests: min replicas"
        typical = _median(capacities)
        have = [*capacities, *[typical] * max(0, current - len(capacities))]
        total = sum(have)
        fig = f"demand {demand:.0f} tokens/s, {len(have)} replicas carry {total:.0f} at capacity"
        up = current + math.ceil((demand / p.utilization - total) / typical)
        slo = _slo_breach(pool)
        if slo:
            return max(up, current + 1), f"{slo}; {fig}"
        if up > current:
            return up, f"{fig}: {up} replicas at {p.utilization:.0%}"
        keep = demand / (p.utilization * (1 - p.hysteresis))
        gone = 0
        for c in sorted(have)[: max(0, current - 1)]:  # the slowest first
            if total - c < keep:
                break
            total, gone = total - c, gone + 1
        if gone:
            return (
                current - gone,
                f"{fig}: {current - gone} carry it with {p.hysteresis:.0%} headroom",
            )
        return current, f"{fig}: within the band"


def _window_mean(
    ring: deque[tuple[float, float]], now: float, value: float, window_s: float
) -> float:
    """`value` taken at `now` into `ring`, and the mean of the last `window_s` of it."""
    ring.append((now, value))
    while ring[0][0] < now - window_s:
        ring.popleft()
    return sum(v for _, v in ring) / len(ring)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _in_tokens(
    pool: Pool, usable: Sequence[Sample], mem: PoolMemory
) -> tuple[float, list[float]] | None:
    """The pool's demand in tokens per second and each usable replica's capacity (the
    module's formulas); None where they cannot be told (no shape, no speed learned, no
    batch learned): the rules then run in requests."""
    if pool.shape is None or mem.capacity is None:
        return None
    prompt, output = pool.shape
    tokens = prompt + output
    if not (math.isfinite(tokens) and 0 < tokens <= 1 << 24 and min(prompt, output) >= 0):
        return None
    learned = [s.speed for s in usable if s.speed is not None and s.speed.usable]
    if not learned:
        return None
    typical = ReplicaSpeed(*(_median([getattr(x, f) for x in learned]) for f in _SPEED_FIELDS))
    itl = pool.policy.itl_p90_ms
    demand, capacities = 0.0, []
    if not typical.request_s(prompt, output, 1.0) > 0:  # nothing takes time: no rate
        return None
    for s in usable:
        speed = s.speed if s.speed is not None and s.speed.usable else typical
        if not speed.request_s(prompt, output, 1.0) > 0:
            speed = typical
        load = s.running + s.waiting
        if load:
            demand += load * tokens / speed.request_s(prompt, output, max(1.0, s.running))
        batch = max(1.0, mem.batch.get(s.replica, mem.capacity))
        if itl is not None and speed.per_batch_s > 0:  # no more than its SLO allows
            allowed = 1 + (itl / 1e3 - speed.decode_s) / speed.per_batch_s
            batch = max(1.0, min(batch, math.floor(allowed)))
        capacities.append(batch * tokens / speed.request_s(prompt, output, batch))
    if pool.waiting_at_router:
        demand += pool.waiting_at_router * tokens / typical.request_s(prompt, output, 1.0)
    if not capacities or not all(math.isfinite(c) and c > 0 for c in capacities):
        return None
    if not (math.isfinite(demand) and demand >= 0):
        return None
    return demand, capacities


_SPEED_FIELDS = ("overhead_s", "prefill_s", "decode_s", "per_batch_s")


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
