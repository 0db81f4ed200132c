"""The admission gate: the async shell around admission.Admission, fed from the registry.

`enter` admits a request at once or parks it on a future until dispatch
admits it, its TTL passes (504) or the client goes away (it leaves the queue
at once); `leave` is called when an admitted request finishes. A background
`run` loop refreshes each pool's capacity and KV usage from the endpoints'
scraped metrics every `tick_s`, expires waiters and dispatches.

Learned capacity per endpoint: `admission.Capacity` (the most requests seen
running; smaller only when requests wait on several scrapes in a row; never
less than `default_capacity`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cgn_core.errors import Overloaded, UpstreamTimeout
from cgn_router.fleetshare import waiting_of
from cgn_router.metrics import RouterMetrics
from cgn_router.registry import Registry
from cgn_router.routing.admission import Admission, Capacity, Ticket, Verdict
from cgn_router.settings import AdmissionSettings
from cgn_router.types import EndpointId
from cgn_router.workers.shared import SharedLoad

if TYPE_CHECKING:
    from cgn_router.ledger import Ledger

log = logging.getLogger(__name__)
REFRESH_S = 0.5


class Gate:
    def __init__(
        self,
        settings: AdmissionSettings,
        registry: Registry,
        metrics: RouterMetrics,
        shared: SharedLoad | None = None,
    ):
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.shared = shared  # with several workers: what their admissions share (shared.py)
        self._heads: set[tuple[str, str]] = set()  # (band, pool)s this worker published heads in
        self.adm = Admission(settings.bands)
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.learned: dict[EndpointId, Capacity] = {}
        self._refreshed = (-1, 0.0)  # the registry's version and the time of the last refresh

    def share_with(self, ledger: Ledger, fresh_s: float) -> None:
        """Fair shares across routers (cgn_router/fleetshare.py): a head here waits while
        another router has a tenant waiting in its band and pool that has had less of the
        fleet's tokens, by weight (its record no older than `fresh_s`); the ledger asks what
        waits here each time it publishes, for the others."""
        share, clock = ledger.share, ledger.clock

        def defer(band: str, pool: str, tenant: str, weight: float) -> bool:
            return share.defers(band, pool, tenant, weight, clock(), fresh_s)

        self.adm.defer = defer
        ledger.waiting = lambda: waiting_of(self.adm.waiting_heads())  # at each publish

    def refresh(self) -> None:
        """Each pool's capacity and KV usage from the endpoints that serve it."""
        now = time.monotonic()
        caps: dict[str, float] = {}
        kvs: dict[str, list[float]] = {}
        others: dict[str, float] = {}
        floor = float(self.settings.default_capacity)
        for eid, s in self.registry.states.items():
            pool = s.endpoint.model
            learned = self.learned.setdefault(eid, Capacity(floor))
            cap = learned.value
            load = s.load
            if load is not None and now - load.scraped_at <= self.registry.stale_s:
                cap = learned.observe(load.running, load.waiting, load.scraped_at)
                kvs.setdefault(pool, []).append(load.kv_usage)
                # NOTE: what the engine holds beyond our own requests is other routers' load
                theirs = max(0.0, load.running + load.waiting - load.own_in_flight)
                others[pool] = others.get(pool, 0.0) + theirs
            caps[pool] = caps.get(pool, 0.0) + cap
        for gone in self.learned.keys() - self.registry.states.keys():
            del self.learned[gone]
        self.adm.capacity = caps
        self.adm.kv_usage = {p: sum(v) / len(v) for p, v in kvs.items() if v}
        self.adm.others = others
        for pool in caps:
            self.metrics.saturation.labels(pool).set(self.adm.saturation(pool))

    async def enter(
        self, band: str, tenant: str, pool: str, cost: float = 1.0, weight: float = 1.0
    ) -> float:
        """Wait until the request may proceed; returns the seconds it waited. `cost`: its
        prompt's tokens, charged to `tenant` (over its `weight`) when it is admitted."""
        started = time.monotonic()
        ticket = Ticket(band, tenant, pool, started, cost=cost, weight=weight)
        self._elsewhere((pool,))
        self._tags_in(band, (tenant,))
        verdict = self.adm.offer(ticket)
        if verdict is Verdict.ADMIT:
            self._publish(pool)
            self._tags_out(band, (tenant,))
            return 0.0
        self._publish_heads()
        if verdict is not Verdict.QUEUED:
            self.metrics.admission_rejections.labels(band, verdict.value).inc()
            if verdict is Verdict.UNKNOWN_BAND:
                raise Overloaded(f"band {band!r} is not configured", code="unknown_band")
            raise Overloaded(f"the {band} queue is full; retry later", code="queue_full")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[ticket.id] = fut
        self._depth(band)
        try:
            await fut
        except asyncio.CancelledError:  # the client went away
            if self.waiting.pop(ticket.id, None) is not None:
                self.adm.cancel(ticket)
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self.leave(pool)  # admitted while we were being cancelled
            self._depth(band)
            raise
        waited = time.monotonic() - started
        self.metrics.admission_wait.labels(band).observe(waited)
        return waited

    def leave(self, pool: str, charge: tuple[str, str, float, float] | None = None) -> None:
        """An admitted request has ended; `charge`: (band, tenant, output tokens, weight),
        the engine work it consumed past its prompt, counted to its tenant's share."""
        if charge is not None:
            band, tenant = charge[0], charge[1]
            self._tags_in(band, (tenant,))
            self.adm.charge(*charge)
            self._tags_out(band, (tenant,))
        self.adm.release(pool)
        self._publish(pool)
        self._pump()

    def _pump(self) -> None:
        if self.shared is not None:
            queues = self.adm.queues
            self._elsewhere([t[0].pool for q in queues.values() for t in q.values()])
            for band, tenants in queues.items():
                if tenants:
                    self._tags_in(band, tenants)
        admitted = self.adm.dispatch()
        for ticket in admitted:
            fut = self.waiting.pop(ticket.id, None)
            if fut is None or fut.done():
                self.adm.release(ticket.pool)
            else:
                fut.set_result(None)
            self._publish(ticket.pool)
            self._depth(ticket.band)
        if self.shared is not None:
            for band in {t.band for t in admitted}:
                self._tags_out(band, {t.tenant for t in admitted if t.band == band})
            self._publish_heads()

    def served_elsewhere(self, tenant: str, tokens: float) -> None:
        """Another router served `tenant` `tokens` (the usage ledger, ledger.py): counted to
        its share here. NOTE: told to one worker of a router only (the daemon wires the
        first): the workers share their tags, and each adding it would count it again."""
        for band in self.adm.finish:
            self._tags_in(band, (tenant,))
        for band in self.adm.served_elsewhere(tenant, tokens):
            self._tags_out(band, (tenant,))

    def _tags_in(self, band: str, tenants: Iterable[str]) -> None:
        """The band's virtual time and `tenants`' tags: the largest this worker or another
        has reached (tags only grow)."""
        if self.shared is None or band not in self.adm.vtime:
            return
        adm, shared = self.adm, self.shared
        adm.vtime[band] = max(adm.vtime[band], shared.tag(band))
        tags = adm.finish[band]
        for tenant in tenants:
            theirs = shared.tag(f"{band}\0{tenant}")
            if theirs > tags.get(tenant, 0.0):
                tags[tenant] = theirs

    def _tags_out(self, band: str, tenants: Iterable[str]) -> None:
        if self.shared is None or band not in self.adm.vtime:
            return
        self.shared.set_tag(band, self.adm.vtime[band])
        tags = self.adm.finish[band]
        for tenant in tenants:
            if tenant in tags:
                self.shared.set_tag(f"{band}\0{tenant}", tags[tenant])

    def _publish_heads(self) -> None:
        """The earliest start this worker has waiting per band and pool, for the others to
        defer to (and an end to those it no longer has)."""
        if self.shared is None:
            return
        heads = self.adm.heads()
        for band, pool in self._heads - heads.keys():
            self.shared.publish_head(f"{band}\0{pool}", None)
        for (band, pool), (start, tenant) in heads.items():
            self.shared.publish_head(f"{band}\0{pool}", start, tenant)
        self._heads = set(heads)

    def _elsewhere(self, pools: Iterable[str]) -> None:
        """The other workers' admitted requests in `pools`, and the earliest starts they
        have waiting there, as they stand now."""
        if self.shared is None:
            return
        adm, shared = self.adm, self.shared
        pools = set(pools)
        for pool in pools:
            adm.workers[pool] = shared.admitted_elsewhere(pool)
        for band in adm.bands:
            for pool in pools:
                head = shared.earliest_head(f"{band}\0{pool}")
                if head is None:
                    adm.elsewhere.pop((band, pool), None)
                else:
                    adm.elsewhere[band, pool] = head

    def _publish(self, pool: str) -> None:
        if self.shared is not None:
            self.shared.publish_admitted(pool, self.adm.active[pool])

    def _depth(self, band: str) -> None:
        self.metrics.queue_depth.labels(band).set(self.adm.depth[band])

    async def run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # NOTE: top of the gate's loop: queued requests depend on it
                log.exception("admission tick failed; the next tick retries")
            await asyncio.sleep(self.settings.tick_s)

    def _tick(self) -> None:
        """Refresh the pools' saturation, time out expired tickets, admit what now fits.

        NOTE: refreshing walks every endpoint, so it runs when an endpoint came or went and
        otherwise every REFRESH_S, not every tick: scraped loads change once a second."""
        now = time.monotonic()
        version = self.registry.version
        if version != self._refreshed[0] or now - self._refreshed[1] >= REFRESH_S:
            self.refresh()
            self._refreshed = (version, now)
        for ticket in self.adm.expire(time.monotonic()):
            fut = self.waiting.pop(ticket.id, None)
            self.metrics.admission_rejections.labels(ticket.band, "ttl").inc()
            self._depth(ticket.band)
            if fut is not None and not fut.done():
                ttl = self.settings.bands[ticket.band].ttl_s
                fut.set_exception(
                    UpstreamTimeout(
                        f"waited {ttl:.0f}s in the {ticket.band} queue", code="queue_timeout"
                    )
                )
        self._pump()
