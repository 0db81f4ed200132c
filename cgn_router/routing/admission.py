"""Admission: *when* a request may proceed (routing decides *where*). Pure; gate.py does the I/O.

Saturation of a pool (the endpoints serving one model) is one number: the
worse of its batch occupancy, (requests admitted and not finished + requests
other routers have at its engines) / (learned batch capacity), and its KV
usage. Requests admitted here count from the moment of admission (a lease),
so a burst that arrives at once cannot slip past the ceiling before any of
it reaches an engine. Other routers' requests come from the engines' own
running and waiting counts (the shared truth every router scrapes) less this
router's requests there at the time of the scrape, so several routers in
front of one pool hold the same ceilings as one (to within a scrape).

Each priority band has a ceiling: a request is admitted at once while its
band has nobody waiting and the pool would stay at or below the ceiling;
otherwise it waits in its band's queue. Lower ceilings for lower bands make
the cluster degrade from the bottom up: bronze waits first, platinum last.
Dispatch serves bands in priority order; within a band, tenants share by the engine work
they consume, in tokens (start-time fair queuing, #58): each request costs its prompt's
tokens when it is admitted and, when it ends, its output's less the prompt tokens the
engine found cached (`charge`), divided by its tenant's weight; each tenant carries the
virtual time its work so far reaches (`finish`), a request's start is the later of that
and the band's virtual time (the start of the last one admitted), and the waiting head
with the earliest start goes next. So a tenant of 8k-token prompts gets as many tokens
as one of 1k prompts (an eighth of the requests), one of weight 2 twice as many, and one
that comes back after idling starts at the band's virtual time (no credit saved up).
Each tenant's requests keep their order. With several router workers (`--workers`), the
virtual times and the tags are shared through their table (each worker keeps the largest
it has seen: tags only grow there, so a credit for cached prompt tokens stays with the
worker that served the request), and each publishes the earliest start of the heads it
has waiting per band and pool: a worker admits a head only if no other worker waits with
an earlier one there, so a freed slot goes to the router's earliest head, whichever
worker holds it. Across routers, a head also waits while another router has a tenant
waiting in its band and pool that has had less of the fleet's tokens, by weight
(`defer`, cgn_router/fleetshare.py). A full queue refuses at once (503); a request that
waits past its band's TTL is refused (504); a cancelled request leaves its queue
immediately.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from cgn_router.settings import BandSettings

AHEAD = 1e-3  # a start this much later than another worker's head is still its turn


def tenant_tag(tenant: str) -> int:
    """A tenant's 16-bit mark in the workers' table (the same in every worker process): which
    tenant another worker's earliest head is, to within a 1 in 65,536 chance."""
    return zlib.crc32(tenant.encode("utf-8", "surrogatepass")) & 0xFFFF


@dataclass(eq=False, slots=True)
class Ticket:
    band: str
    tenant: str
    pool: str
    enqueued: float
    deadline: float = 0.0
    cost: float = 1.0  # engine work charged on admission: its prompt's tokens
    weight: float = 1.0  # its tenant's share weight (a key's `weight`)
    id: int = field(default_factory=itertools.count().__next__)


@dataclass(slots=True)
class Capacity:
    """One endpoint's learned batch capacity, from its scraped running/waiting counts.

    It grows at once to the most requests seen running. It shrinks only on
    evidence that the batch is full below that: requests waiting on
    `FULL_SCRAPES` scrapes in a row; it then becomes the most seen running
    over those scrapes. A single scrape with requests waiting means little:
    engines queue new arrivals until their next step, whatever their batch.
    Never below `floor` (the configured `default_capacity`).
    """

    FULL_SCRAPES = 3

    floor: float
    slots: float = 0.0
    scraped_at: float = -1.0  # the last scrape counted
    full_scrapes: int = 0  # consecutive scrapes that reported requests waiting
    full_running: float = 0.0  # the most running over those scrapes

    @property
    def value(self) -> float:
        """The capacity now: the learned slots, never below the floor."""
        return max(self.slots, self.floor)

    def observe(self, running: float, waiting: float, scraped_at: float) -> float:
        """Count one scrape (a repeat of the last one changes nothing); the capacity now."""
        if scraped_at != self.scraped_at:
            self.scraped_at = scraped_at
            if waiting > 0 and running >= 1:
                self.full_scrapes += 1
                self.full_running = max(self.full_running, running)
            else:
                self.full_scrapes, self.full_running = 0, 0.0
            if self.full_scrapes >= self.FULL_SCRAPES:
                self.slots = self.full_running  # the batch is full at this size
            else:
                self.slots = max(self.slots, running)
        return self.value


class Verdict(Enum):
    ADMIT = "admit"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"
    UNKNOWN_BAND = "unknown_band"


class Admission:
    def __init__(self, bands: Mapping[str, BandSettings]):
        self.bands = dict(bands)
        self.order = sorted(self.bands, key=lambda b: (self.bands[b].priority, b))
        self.queues: dict[str, OrderedDict[str, deque[Ticket]]] = {
            b: OrderedDict() for b in self.bands
        }
        self.depth: Counter[str] = Counter()
        self.vtime = dict.fromkeys(self.bands, 0.0)  # band -> the start of its last admitted one
        self.finish: dict[str, dict[str, float]] = {b: {} for b in self.bands}  # tenant -> tag
        self.weights: dict[str, float] = {}  # tenant -> its weight, as its last request said
        self.active: Counter[str] = Counter()  # pool -> admitted, not yet finished
        self.capacity: dict[str, float] = {}  # pool -> batch slots
        self.kv_usage: dict[str, float] = {}  # pool -> 0..1
        self.others: dict[str, float] = {}  # pool -> requests other routers have there
        # pool -> requests this router's other workers have admitted there, counted live (the
        # engines' figures, in `others`, show them only from the next scrape)
        self.workers: dict[str, float] = {}
        # (band, pool) -> the earliest start among the heads this router's other workers have
        # waiting there, and its tenant's tag: another tenant's head that would start later
        # waits for it (one order across the router's workers, as in one process). The same
        # tenant's does not: its requests' order between workers is no one else's share,
        # and waiting for the other worker's next tick at each of its requests in turn held a
        # router of two workers to ~50 requests/s (bench/results/router_vs_smg*.md)
        self.elsewhere: dict[tuple[str, str], tuple[float, int]] = {}
        # (band, pool, tenant, weight) -> whether another router waits with a tenant that has
        # had less (cgn_router/fleetshare.py): that head waits for it; None: one router
        self.defer: Callable[[str, str, str, float], bool] | None = None

    def saturation(self, pool: str, extra: int = 0) -> float:
        cap = max(self.capacity.get(pool, 1.0), 1.0)
        # NOTE: `others` holds the other workers' requests that were at the engines at the
        # scrape; the larger of the two counts them once, and the live count at once
        elsewhere = max(self.others.get(pool, 0.0), self.workers.get(pool, 0.0))
        busy = self.active[pool] + elsewhere + extra
        return max(busy / cap, self.kv_usage.get(pool, 0.0))

    def offer(self, t: Ticket) -> Verdict:
        band = self.bands.get(t.band)
        if band is None:
            return Verdict.UNKNOWN_BAND
        if (
            not self.depth[t.band]
            and self._first(t.band, t.pool, t.tenant, self._start(t.band, t.tenant))
            and self.saturation(t.pool, 1) <= band.ceiling
            and not (self.defer is not None and self.defer(t.band, t.pool, t.tenant, t.weight))
        ):
            self.active[t.pool] += 1
            self._admitted(t)
            return Verdict.ADMIT
        if self.depth[t.band] >= band.queue:
            return Verdict.QUEUE_FULL
        t.deadline = t.enqueued + band.ttl_s
        self.queues[t.band].setdefault(t.tenant, deque()).append(t)
        self.depth[t.band] += 1
        return Verdict.QUEUED

    def _first(self, band: str, pool: str, tenant: str, start: float) -> bool:
        """Whether no other worker has another tenant's head waiting in `band` and `pool` that
        starts before `start`."""
        other = self.elsewhere.get((band, pool))
        return other is None or start <= other[0] + AHEAD or other[1] == tenant_tag(tenant)

    def _start(self, band: str, tenant: str) -> float:
        return max(self.vtime[band], self.finish[band].get(tenant, 0.0))

    def _admitted(self, t: Ticket) -> None:
        """Charge `t`'s prompt to its tenant; the band's virtual time moves to its start."""
        start = self._start(t.band, t.tenant)
        self.vtime[t.band] = start
        self.finish[t.band][t.tenant] = start + t.cost / t.weight
        self.weights[t.tenant] = t.weight

    def served_elsewhere(self, tenant: str, tokens: float) -> list[str]:
        """Another router served `tenant` `tokens`: charged to its share in every band where
        it is active here (it waits, or it was served and has not gone idle), so its share
        is the fleet's, not this router's; the bands charged."""
        charged = []
        for band, tags in self.finish.items():
            if tenant in tags or tenant in self.queues[band]:
                self.charge(band, tenant, tokens, self.weights.get(tenant, 1.0))
                charged.append(band)
        return charged

    def charge(self, band: str, tenant: str, tokens: float, weight: float = 1.0) -> None:
        """Work a request of `tenant` consumed beyond its admission's charge: its output,
        less the prompt tokens the engine found cached (charged on admission, computed by
        nobody). A net credit moves the tenant's tag back, never before the band's
        virtual time (no credit saved up)."""
        tags = self.finish.get(band)
        if tags is None or not weight > 0 or not math.isfinite(tokens):
            return
        if tokens > 0:
            tags[tenant] = self._start(band, tenant) + tokens / weight
        elif tokens < 0 and tenant in tags:
            tags[tenant] = max(self.vtime[band], tags[tenant] + tokens / weight)

    def release(self, pool: str) -> None:
        """A request admitted earlier has finished (or was abandoned)."""
        if self.active[pool] > 0:
            self.active[pool] -= 1

    def cancel(self, t: Ticket) -> bool:
        """Take a waiting request out of its queue; False if it is not waiting (any more)."""
        q = self.queues.get(t.band, OrderedDict()).get(t.tenant)
        if not q or t not in q:
            return False
        q.remove(t)
        self._drop(t.band, t.tenant)
        return True

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the requests that have waited past their band's TTL."""
        out = []
        for band, tenants in self.queues.items():
            for tenant in list(tenants):
                q = tenants[tenant]
                while q and q[0].deadline <= now:
                    out.append(q.popleft())
                    self.depth[band] -= 1
                if not q:
                    del tenants[tenant]
        for band, tags in self.finish.items():  # a tenant gone idle, caught up: forgotten
            now_v = self.vtime[band]
            for tenant in [x for x, tag in tags.items() if tag <= now_v]:
                if tenant not in self.queues[band]:
                    del tags[tenant]
        if len(self.weights) > 2 * sum(len(t) for t in self.finish.values()) + 64:
            active = {t for tags in self.finish.values() for t in tags}
            self.weights = {t: w for t, w in self.weights.items() if t in active}
        return out

    def dispatch(self) -> list[Ticket]:
        """Admit waiting requests while their pools allow: bands by priority; within one, the
        head with the earliest start (ties: the tenant that has waited longest)."""
        out: list[Ticket] = []
        for band in self.order:
            tenants, ceiling = self.queues[band], self.bands[band].ceiling
            while tenants:
                best, best_start = None, 0.0
                for tenant, q in tenants.items():
                    start = self._start(band, tenant)
                    head = q[0]
                    if (
                        (best is None or start < best_start)
                        and self.saturation(head.pool, 1) <= ceiling  # else it waits for it
                        and self._first(band, head.pool, tenant, start)
                        and not (
                            self.defer is not None
                            and self.defer(band, head.pool, tenant, head.weight)
                        )
                    ):
                        best, best_start = tenant, start
                if best is None:
                    break
                head = tenants[best].popleft()
                self.active[head.pool] += 1
                self._admitted(head)
                out.append(head)
                self._drop(band, best, rotate=True)
        return out

    def waiting_heads(self) -> list[tuple[str, str, str, float]]:
        """(band, pool, tenant, weight) of every tenant's head waiting here (what other
        routers defer to, fleetshare.py)."""
        return [
            (band, q[0].pool, tenant, q[0].weight)
            for band, tenants in self.queues.items()
            for tenant, q in tenants.items()
        ]

    def heads(self) -> dict[tuple[str, str], tuple[float, int]]:
        """(band, pool) -> the earliest start among the heads waiting here and its tenant's
        tag (what the other workers defer to)."""
        out: dict[tuple[str, str], tuple[float, int]] = {}
        for band, tenants in self.queues.items():
            for tenant, q in tenants.items():
                where, start = (band, q[0].pool), self._start(band, tenant)
                if start < out.get(where, (math.inf, 0))[0]:
                    out[where] = (start, tenant_tag(tenant))
        return out

    def _drop(self, band: str, tenant: str, rotate: bool = False) -> None:
        self.depth[band] -= 1
        tenants = self.queues[band]
        if not tenants[tenant]:
            del tenants[tenant]
        elif rotate:
            tenants.move_to_end(tenant)  # among equal starts, the others go first
