"""The endpoints the router knows, with the live state it keeps for each.

Endpoints come from two sources, merged: the static list in settings and the
etcd prefix `/cognitora/endpoints/` (`endpoint_key_parts`). Re-registering an
endpoint (a lease renewal, a changed field) keeps its live state: in-flight
counts, breaker, scraped load. Cordoned nodes come from `/cognitora/cordon/`.
`views()` freezes everything routing needs into `EndpointView`s, and `begin()`
opens the `Lease` that owns one attempt's accounting on the chosen endpoint:

    begin ── in_flight +1, pending_prefill +uncached, optimistic blocks, session,
      │      breaker.on_attempt, its prefill on the drain clock, a streamed one waiting
      ├─ first_byte() ── pending_prefill -uncached, breaker.on_success, no longer waiting,
      │                  the drain clock set by it
      └─ end(outcome) ── in_flight -1 (pending_prefill -uncached if no first byte),
                          breaker.on_failure when the outcome blames the engine

The drain clock (`EndpointState.queued`): the prefill tokens queued on an endpoint and not
yet computed. Each attempt adds its uncached tokens; they drain as time passes at the
endpoint's learned speed (pending_prefill only falls at first bytes, so a long prompt
nearly done still counted whole); each first byte resets it to the tokens of the attempts
there still without one (a replica faster or slower than learned is corrected at once).
`EndpointView.queued_tokens` is what is left.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.records import Efficiency, fresh_efficiency
from cgn_router.routing.breaker import Breaker
from cgn_router.routing.kv_index import PrefixIndex, TierIndex
from cgn_router.routing.speed import Sample, SpeedFit, median_speed
from cgn_router.sessions import Sessions
from cgn_router.settings import BreakerSettings
from cgn_router.types import (
    DEFAULT_SPEED,
    Endpoint,
    EndpointId,
    EndpointView,
    EngineLoad,
    RequestInfo,
    Speed,
    Usage,
    queue_length,
)
from cgn_router.workers.shared import SharedLoad, SharedSpeed

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EndpointState:
    endpoint: Endpoint
    breaker: Breaker
    source: str  # "static" | "etcd"
    in_flight: int = 0
    pending_prefill: int = 0
    load: EngineLoad | None = None
    scrape_error: str = ""
    since: float = field(default_factory=time.monotonic)  # when it became routable here
    shared: SharedLoad | None = None  # with several workers: where they count together
    fit: SpeedFit = field(default_factory=SpeedFit)  # its speed, learned (routing/speed.py)
    speed: Speed | None = None  # the fit as last read (None: never)
    speed_at: float = -math.inf
    # streamed attempts sent here with no first byte yet, oldest first (`lag`)
    waiting: dict[int, Lease] = field(default_factory=dict)
    queued: float = 0.0  # prefill tokens still to compute as of `queued_at` (the drain clock)
    queued_at: float = 0.0
    # LoRA adapters loaded at run time, as last scraped and since loaded by this router
    adapters: set[str] = field(default_factory=set)
    adapter_slots: int | None = None  # how many it holds at most, as scraped (None: unknown)

    def holds(self, adapter: str) -> bool:
        """Whether LoRA `adapter` is loaded here (at start, or at run time)."""
        return adapter in self.endpoint.adapters or adapter in self.adapters

    def counted(self) -> None:
        """`in_flight` or `pending_prefill` changed: tell the other workers."""
        if self.shared is not None:
            self.shared.publish(self.endpoint.id, self.in_flight, self.pending_prefill)

    def router_counts(self) -> tuple[int, int]:
        """(requests in flight, prefill tokens pending) of the whole router: this worker's
        and, with several, the others'."""
        if self.shared is None:
            return self.in_flight, self.pending_prefill
        theirs, pending = self.shared.others(self.endpoint.id)
        return self.in_flight + theirs, self.pending_prefill + pending

    def queued_tokens(self, now: float, speed: Speed, lag: float) -> float:
        """The prefill tokens still ahead of a new request here: this worker's on the drain
        clock (never more than it has pending), and the other workers' as they count them."""
        mine = min(self._left(now, speed, lag), self.pending_prefill)
        return mine + self.router_counts()[1] - self.pending_prefill

    def _left(self, now: float, speed: Speed, lag: float) -> float:
        """The clock's tokens at `now`, drained at `speed` slowed by `lag` (a replica
        running late drains late)."""
        rate = 1.0 / (speed.prefill_s * max(1.0, lag))
        return max(0.0, self.queued - max(0.0, now - self.queued_at) * rate)

    def queue(self, tokens: int, now: float, speed: Speed, lag: float) -> None:
        """An attempt's `tokens` of prefill join the clock."""
        self.queued, self.queued_at = self._left(now, speed, lag) + tokens, now

    def drained(self, now: float) -> None:
        """A first byte: FIFO, what was queued before it is done; what is still pending
        (those after it) is left to do, from now."""
        self.queued, self.queued_at = float(self.pending_prefill), now

    def lag(self, now: float, speed: Speed) -> float:
        """How many times longer than `speed` predicts the oldest stream waiting here for its
        first byte has already waited (1 when none is late): the news that a replica is
        slower than learned (a cold one judged by its peers, one that slowed or hung)
        before any answer can say so."""
        oldest = next(iter(self.waiting.values()), None)
        if oldest is None:
            return 1.0
        return max(1.0, (now - oldest.began_at) / max(oldest.expected(speed), MIN_EXPECTED_S))


# How an attempt ended. `failed`: refused or broken before the first byte (the request may
# go elsewhere); `busy`: the engine said 429 (not its fault); `upstream_error`: the stream
# broke after the first byte. Both of those last that blame the engine count to its breaker.
Outcome = Literal["ok", "client_error", "client_disconnected", "upstream_error", "failed", "busy"]
BLAMES_ENGINE = frozenset({"upstream_error", "failed"})
SPEED_READ_S = 1.0  # an endpoint's speed is refitted at most this often
MIN_EXPECTED_S = 1e-3  # a lag divides by a prediction no smaller than this


@dataclass(slots=True)
class Lease:
    """One attempt's hold on an endpoint (`Registry.begin`); see the module docstring."""

    state: EndpointState
    predicted: int  # prompt tokens expected cached on the endpoint
    uncached: int  # the rest: pending prefill until the first byte
    requeue: Callable[[float], None] = lambda now: None  # re-place it in its load order
    first_byte_at: float | None = None
    ended_at: float | None = None  # None while it holds the endpoint
    # what its speed sample needs (routing/speed.py): when it began, the prefill tokens
    # routed there ahead of it, the requests in flight there with it
    began_at: float = 0.0
    ahead: int = 0
    batch: int = 1

    def expected(self, speed: Speed) -> float:
        """Its first byte's time, as `speed` predicts it for the queue it joined."""
        return speed.ttft(self.ahead + self.uncached, others=self.batch - 1)

    def sample(self, usage: Usage | None) -> Sample | None:
        """This attempt as an observation of its endpoint's speed (None: it gave none: no
        first byte, or no end yet). The engine's usage says what it really computed."""
        if self.first_byte_at is None or self.ended_at is None:
            return None
        uncached = self.uncached if usage is None else usage.prompt_tokens - usage.cached_tokens
        return Sample(
            work_tokens=self.ahead + max(0, uncached),
            ttft_s=self.first_byte_at - self.began_at,
            output_tokens=0 if usage is None else usage.completion_tokens,
            decode_s=self.ended_at - self.first_byte_at,
            batch=self.batch,
        )

    def late(self) -> Sample | None:
        """A stream moved before its first byte (legs.py) as a sample: the time it waited, a
        lower bound of its first token's, so its replica is not guessed at its peers' speed."""
        if self.ended_at is None or self.first_byte_at is not None:
            return None
        waited = self.ended_at - self.began_at
        return Sample(self.ahead + self.uncached, waited, 0, 0.0, self.batch)

    def first_byte(self, now: float) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = now
            self.state.waiting.pop(id(self), None)
            self.state.pending_prefill -= self.uncached
            self.state.drained(now)
            self.state.counted()
            self.state.breaker.on_success()

    def end(self, outcome: Outcome, now: float) -> None:
        if self.ended_at is not None:
            return
        self.ended_at = now
        self.state.in_flight -= 1
        if self.first_byte_at is None:
            self.state.waiting.pop(id(self), None)
            self.state.pending_prefill -= self.uncached
        self.state.counted()
        self.requeue(now)
        if outcome in BLAMES_ENGINE:
            self.state.breaker.on_failure(now)


class LoadOrder:
    """One model's endpoints by what waits on them (requests, rounded down), least first.

    Kept up to date as leases open and end and as scrapes land, so the least loaded come
    without scanning the model's endpoints per request."""

    def __init__(self) -> None:
        self._buckets: dict[int, dict[EndpointId, None]] = {}
        self._at: dict[EndpointId, int] = {}

    def place(self, eid: EndpointId, queue: int) -> None:
        old = self._at.get(eid)
        if old == queue:
            return
        if old is not None:
            self._drop(eid, old)
        self._at[eid] = queue
        self._buckets.setdefault(queue, {})[eid] = None

    def remove(self, eid: EndpointId) -> None:
        old = self._at.pop(eid, None)
        if old is not None:
            self._drop(eid, old)

    def least(self, n: int) -> list[EndpointId]:
        """The `n` least loaded (ties: the longest at that load first)."""
        out: list[EndpointId] = []
        for queue in sorted(self._buckets):
            out += itertools.islice(self._buckets[queue], n - len(out))
            if len(out) >= n:
                break
        return out

    def _drop(self, eid: EndpointId, queue: int) -> None:
        bucket = self._buckets[queue]
        del bucket[eid]
        if not bucket:
            del self._buckets[queue]


class Registry:
    def __init__(
        self,
        breaker: BreakerSettings,
        index: PrefixIndex,
        sessions: Sessions,
        stale_s: float,
        tiers: TierIndex | None = None,
        shared: SharedLoad | None = None,
        speeds: SharedSpeed | None = None,
    ):
        self.shared = shared  # with several workers: their counts per endpoint
        self.speeds = speeds  # with several workers: what each learned of each endpoint
        self.breaker = breaker
        self.stale_s = stale_s
        self.index = index
        self.tiers = tiers or TierIndex()  # what each node's cgn-kvcached holds
        self.stores: dict[str, tuple[str, str]] = {}  # node -> its kvcached's events URL, token
        self.sessions = sessions
        self.states: dict[EndpointId, EndpointState] = {}
        # model -> its endpoints (an id names its model, so an endpoint never moves)
        self.by_model: dict[str, dict[EndpointId, EndpointState]] = {}
        self.load_order: dict[str, LoadOrder] = {}
        self.version = 0  # bumped when an endpoint comes or goes
        self.cordoned: set[str] = set()
        self.efficiency: dict[str, Efficiency] = {}  # node -> its efficiency record
        self._prefill: dict[str, int] = {}  # model -> its prefill-role endpoints, counted
        self._typical: dict[str, tuple[float, Speed | None]] = {}  # model -> (when, median)
        self._diverged: set[EndpointId] = set()  # endpoints whose fit failed, logged

    def has_prefill_pool(self, model: str) -> bool:
        """Some endpoint of `model` is a prefill replica (disaggregation is possible)."""
        return self._prefill.get(model, 0) > 0

    def _count_role(self, endpoint: Endpoint, delta: int) -> None:
        if endpoint.role == "prefill":
            left = self._prefill.get(endpoint.model, 0) + delta
            if left:
                self._prefill[endpoint.model] = left
            else:
                self._prefill.pop(endpoint.model, None)

    def upsert(self, endpoint: Endpoint, source: str) -> bool:
        """Add or update an endpoint; True when it is new. Live state survives updates."""
        state = self.states.get(endpoint.id)
        if state is None:
            b = Breaker(self.breaker.failures, self.breaker.open_s)
            state = EndpointState(endpoint, b, source, shared=self.shared)
            self.states[endpoint.id] = state
            self.by_model.setdefault(endpoint.model, {})[endpoint.id] = state
            self.load_order.setdefault(endpoint.model, LoadOrder()).place(endpoint.id, 0)
            self._count_role(endpoint, 1)
            self.version += 1
            return True
        if state.endpoint != endpoint:
            if state.endpoint.url != endpoint.url:  # a different engine now: nothing carries
                self.index.forget(endpoint.id)
                state.load = None
            self._count_role(state.endpoint, -1)
            self._count_role(endpoint, 1)
            state.endpoint = endpoint
        state.source = source
        return False

    def remove(self, eid: EndpointId) -> EndpointState | None:
        state = self.states.pop(eid, None)
        if state is not None:
            self.index.forget(eid)
            if self.speeds is not None:
                self.speeds.forget(eid)
            self.version += 1
            self._count_role(state.endpoint, -1)
            model = state.endpoint.model
            peers = self.by_model[model]
            del peers[eid]
            self.load_order[model].remove(eid)
            if not peers:
                del self.by_model[model], self.load_order[model]
        return state

    def replace_source(self, source: str, endpoints: Iterable[Endpoint]) -> list[EndpointId]:
        """Make `source`'s endpoints exactly `endpoints`; returns the ids removed."""
        keep = {e.id for e in endpoints}
        for e in endpoints:
            self.upsert(e, source)
        gone = [eid for eid, s in self.states.items() if s.source == source and eid not in keep]
        for eid in gone:
            self.remove(eid)
        return gone

    def fresh_load(self, state: EndpointState, now: float) -> EngineLoad | None:
        """The endpoint's scraped load, or None when missing or older than `stale_s`."""
        load = state.load
        return load if load is not None and now - load.scraped_at <= self.stale_s else None

    def serves(self, model: str) -> bool:
        return model in self.by_model

    def models(self) -> set[str]:
        return set(self.by_model)

    def views(
        self,
        req: RequestInfo,
        now: float,
        exclude: frozenset[EndpointId] = frozenset(),
        picks: int | None = None,
    ) -> list[EndpointView]:
        """Snapshots of the endpoints serving `req.model` (with `req.adapter` loaded, where
        it names one), minus `exclude`.

        With `picks`, a short list instead of all of them: the `picks` endpoints holding
        most of the prompt, the `picks` least loaded, the session's owner, and those whose
        node's store holds the prompt's first block."""
        peers = self.by_model.get(req.model, {})
        owner = self.sessions.owner(req.session, now)
        blocks, index = req.blocks, self.index
        if picks is None:
            picked: Iterable[EndpointId] = peers
            matched = index.match_all(blocks, now) if blocks else {}
        else:  # one walk for the warmest, one for the rest of the short list
            matched = index.match_all(blocks, now, top=picks) if blocks else {}
            picked = self._short_list(peers, matched, owner, req, picks)
            rest = index.mask(e for e in picked if e not in matched)
            if blocks and rest:
                matched |= index.match_all(blocks, now, rest)
        adapter = req.adapter  # NOTE: here, not in a filter a policy could leave out
        return [
            self._view(peers[eid], matched.get(eid, 0), owner == eid, req, now)
            for eid in picked
            if eid not in exclude and (adapter is None or peers[eid].holds(adapter))
        ]

    def _short_list(
        self,
        peers: Mapping[EndpointId, EndpointState],
        warm: Mapping[EndpointId, int],
        owner: EndpointId | None,
        req: RequestInfo,
        limit: int,
    ) -> list[EndpointId]:
        mine = [e for e in warm if e in peers]  # (a hash-key collision may name another's)
        idle = self.load_order[req.model].least(limit)
        picked = dict.fromkeys([*mine, *idle])  # ordered: the same request, the same list
        if owner is not None and owner in peers:
            picked[owner] = None
        if req.blocks and self.stores:
            first = req.blocks[:1]
            picked.update(
                (e, None)
                for e, s in peers.items()
                if s.endpoint.node in self.stores
                and self.tiers.extend(s.endpoint.node, first, 0) != (0, 0)
            )
        return list(picked)

    def requeue(self, s: EndpointState, now: float) -> None:
        """Re-place an endpoint in its model's load order: what waits on it, as the load
        scorer counts it (this router's requests there, or the engine's queue if more)."""
        order = self.load_order.get(s.endpoint.model)
        if order is not None and s.endpoint.id in self.states:
            in_flight = s.router_counts()[0]
            order.place(s.endpoint.id, int(queue_length(in_flight, self.fresh_load(s, now))))

    def learn(self, eid: EndpointId, sample: Sample, now: float) -> bool:
        """An answered attempt's observation of `eid`'s speed; False when refused (not a
        possible one) or the endpoint is gone."""
        state = self.states.get(eid)
        if state is None or not state.fit.add(sample, now):
            return False
        if self.speeds is not None:
            self.speeds.publish(eid, state.fit.state())
        if state.speed is None or not state.speed.warm:
            state.speed = None  # a cold one's first samples count at once
        return True

    def speed(self, s: EndpointState, now: float) -> Speed:
        """`s`'s learned speed; a replica not yet warm has its model's typical one (the
        median of its warm peers) or the default prior. Refitted at most every SPEED_READ_S
        (not on every sample: a fit is two small solves, on the request path), from every
        worker's samples where there are several."""
        if s.speed is None or now - s.speed_at > SPEED_READ_S:
            fit = s.fit
            if self.speeds is not None:
                fit = fit.combined(self.speeds.others(s.endpoint.id))
            diverged = fit.diverged
            s.speed, s.speed_at = fit.speed(now), now
            if fit.diverged > diverged and s.endpoint.id not in self._diverged:
                self._diverged.add(s.endpoint.id)
                log.warning("endpoint %s: its speed fit cannot be solved: the prior stands in "
                            "(logged once)", s.endpoint.id)  # fmt: skip
        if s.speed.warm:
            return s.speed
        model = s.endpoint.model
        at, typical = self._typical.get(model, (-math.inf, None))
        if now - at > SPEED_READ_S:
            peers = self.by_model.get(model, {}).values()
            typical = median_speed([p.speed for p in peers if p.speed is not None])
            self._typical[model] = (now, typical)
        return typical or DEFAULT_SPEED

    def _view(
        self, s: EndpointState, matched: int, owner: bool, req: RequestInfo, now: float
    ) -> EndpointView:
        node = s.endpoint.node
        ram, ssd = self.tiers.extend(node, req.blocks, matched) if req.blocks and node else (0, 0)
        in_flight, pending = s.router_counts()
        speed = self.speed(s, now)
        lag = s.lag(now, speed)
        return EndpointView(
            endpoint=s.endpoint,
            cordoned=node in self.cordoned,
            breaker_open=s.breaker.blocks(now),
            in_flight=in_flight,
            pending_prefill=pending,
            load=self.fresh_load(s, now),
            matched_blocks=matched,
            node_ram_blocks=ram,
            node_ssd_blocks=ssd,
            session_owner=owner,
            tokens_per_joule=fresh_efficiency(self.efficiency.get(node), time.time()),
            speed=speed,
            queued_tokens=s.queued_tokens(now, speed, lag),
            lag=lag,
        )

    def tokens_per_joule(self, eid: str) -> float | None:
        """The measured output tokens per joule of endpoint `eid`'s node (None: not known)."""
        s = self.states.get(EndpointId(eid))
        if s is None:
            return None
        return fresh_efficiency(self.efficiency.get(s.endpoint.node), time.time())

    def begin(
        self, view: EndpointView, req: RequestInfo, now: float, *, streamed: bool = False
    ) -> Lease:
        """An attempt of `req` on the endpoint `view` was chosen for: account for it. A
        `streamed` one's first byte is its first token: it is watched for `lag` meanwhile."""
        state = self.states[view.id]
        predicted = min(view.matched_blocks * BLOCK_SIZE, req.prompt_tokens)
        uncached = req.prompt_tokens - predicted
        requeue = functools.partial(self.requeue, state)
        lease = Lease(
            state,
            predicted,
            uncached,
            requeue,
            began_at=now,
            ahead=round(view.queued_tokens),
            batch=view.in_flight + 1,
        )
        state.queue(uncached, now, view.speed, view.lag)
        if streamed:
            state.waiting[id(lease)] = lease
        state.breaker.on_attempt(now)
        state.in_flight += 1
        state.pending_prefill += lease.uncached
        state.counted()
        self.requeue(state, now)
        self.index.routed(view.id, req.blocks, now, exact=bool(state.endpoint.kv_events_url))
        self.sessions.record(req.session, view.id, now)
        return lease
