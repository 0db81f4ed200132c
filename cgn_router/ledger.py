"""Tenants' usage against their budgets, counted across every router (#58; cgn_core/budgets.py).

Each router worker is one writer. It counts what it serves (`LedgerObserver`, from
each request's `Ended`: prompt and completion tokens; joules where the node that
answered has a measured efficiency), publishes the counts of the tenants it served at
most every `publish_s` (`publish`: one record per tenant, only those that changed, in
transactions of up to 100), and follows every other writer's records (followers.py).
A tenant's usage is its own count plus the others' last records, so
several routers and workers hold one budget: a worker sees another's usage within
`publish_s` plus etcd's watch delay (one etcd round trip). A budget can therefore be
overrun by what the other writers served in that window, plus the requests in
flight when it was reached (each is charged when it ends).

A worker resumes from its own records when it starts (the usage is kept across a
restart); its writer name is `budgets.instance` (default: the host's name and the
OpenAI port) and its worker index, so a restarted router takes its records back up.
A record from a past month counts for nothing; each worker deletes those it knows of
when it starts and when a month begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping

from cgn_core import keys
from cgn_core.budgets import (
    Budget,
    Exhausted,
    Period,
    UsageEntry,
    Used,
    exhausted,
    key_scope,
    period,
    remaining,
)
from cgn_core.errors import CognitoraError, RateLimited
from cgn_core.etcd import EtcdClient, Op
from cgn_core.settings import EtcdSettings
from cgn_router.fleetshare import FleetShare, Waiting, to_doc
from cgn_router.routing.lifecycle import Ended, Record
from cgn_router.settings import BudgetSettings

log = logging.getLogger(__name__)
FINAL_WRITE_S = 2.0  # the most a stopping router waits to write its last count


def writer_name(settings: BudgetSettings, http_port: int, worker: int) -> str:
    """A router worker's name among the ledger's writers: `budgets.instance`, else the host's
    name and the OpenAI port (a port the system picks, 0, names nothing: the process id
    stands in, and a restart starts a new record), then the worker's index."""
    base = settings.instance
    if not base:
        host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:80].strip("-._")
        base = f"{host or 'router'}-{http_port or f'pid{os.getpid()}'}"
    return f"{base}.w{worker}"


def _router(writer: str) -> str:
    """The router a writer (`<instance>.w<worker>`) belongs to."""
    return writer.rsplit(".w", 1)[0]


class Ledger:
    """This worker's count of each tenant's usage, the other writers' records, the budgets."""

    def __init__(
        self,
        writer: str,
        clock: Callable[[], float] = time.time,
        elsewhere: Callable[[str, float], None] | None = None,
    ):
        self.writer, self.clock = writer, clock
        # told (tenant, tokens) as another router's count of a tenant grows: its admission
        # charges them to the tenant's share here (fairness across routers, gate.py)
        self.elsewhere = elsewhere
        self.router = _router(writer)  # its workers' writers share this
        self.period: Period = period(clock())
        self.own: dict[str, Used] = {}
        self.changed: set[str] = set()  # tenants whose own count is not yet published
        self.others: dict[str, dict[str, UsageEntry]] = {}  # tenant -> writer -> its record
        self.budgets: dict[str, Budget] = {}  # tenant -> its budget (tenants with one only)
        self.resumed = False
        self.failing = False  # its last write failed (logged once until one succeeds)
        self._swept = ""  # the month whose past records were last deleted
        self._own_past: set[str] = set()  # this writer's records of a month that is over
        # the others' usage of each tenant with a budget in this period, kept as their
        # records come: a record changes its own tenant's sum, nothing else
        self._theirs: dict[str, Used] = {}
        # every tenant's fleet-wide rate, and who waits at other routers (fleetshare.py)
        self.share = FleetShare()
        # what this worker has waiting, for the others: asked when its record is written
        # (the gate's queues, Gate.share_with)
        self.waiting: Callable[[], Waiting] = dict
        self.waiting_published = False  # its record is in etcd

    # ---- counting ------------------------------------------------------------------------

    def _roll(self, now: float) -> None:
        """Start the next day (and month) once the current one is over."""
        if now < self.period.day_ends_unix:
            return
        p = period(now)
        new_month = p.month != self.period.month
        for used in self.own.values():
            used.tokens_day = used.joules_day = 0.0
            if new_month:
                used.tokens_month = 0.0
        if new_month:
            self._own_past.update(f"{self.writer}/{t}" for t in self.own)
            self.own = {}
            self.changed.clear()
        self.period = p
        self._recount()

    def charge(self, tenant: str, tokens: float, joules: float = 0.0) -> None:
        if tokens <= 0 and joules <= 0:
            return
        self._roll(self.clock())
        used = self.own.get(tenant)
        if used is None:
            used = self.own[tenant] = Used()
        used.tokens_day += tokens
        used.tokens_month += tokens
        used.joules_day += joules
        self.changed.add(tenant)
        if not tenant.startswith("@"):  # a key's own scope is no tenant's share
            self.share.served(tenant, tokens, self.clock())

    def used(self, tenant: str) -> Used:
        """`tenant`'s usage in this period, over every writer."""
        self._roll(self.clock())
        theirs = self._theirs.get(tenant)
        if theirs is None:  # a tenant without a budget: no sum kept, counted now
            theirs = self._count(tenant)
        out = Used(*theirs.as_list())
        if (mine := self.own.get(tenant)) is not None:
            out.add(mine)
        return out

    def _count(self, tenant: str) -> Used:
        out = Used()
        for entry in self.others.get(tenant, {}).values():
            out.add(entry.in_period(self.period))
        return out

    def _recount(self) -> None:
        self._theirs = {tenant: self._count(tenant) for tenant in self.budgets}

    def check(self, tenant: str) -> Exhausted | None:
        """The budget `tenant` has used up, if any (a tenant without a budget: None)."""
        b = self.budgets.get(tenant)
        if b is None:
            return None
        return exhausted(b, self.used(tenant), self.period)

    def admit(self, tenant: str, key_id: str = "") -> None:
        """RateLimited (429 `budget_exhausted`, Retry-After: until it resets) when `tenant`,
        or the API key `key_id` (a budget of its own), has used up a budget."""
        for scope in (tenant, key_scope(key_id) if key_id else ""):  # no key id: auth off
            hit = self.check(scope) if scope else None
            if hit is not None:
                wait = max(1, int(hit.resets_unix - self.clock()) + 1)
                who = f"key {key_id}" if scope != tenant else f"tenant {tenant!r}"
                raise RateLimited(hit.message(who), code="budget_exhausted", retry_after_s=wait)

    def remaining_rows(self, limit: int) -> list[tuple[str, str, float]]:
        """(tenant, budget, what is left) of the `limit` tenants with the least left of a
        budget (as a fraction of it): the metrics' bounded view."""
        rows = []
        for tenant, b in self.budgets.items():
            left = remaining(b, self.used(tenant))
            limits = b.to_json()
            tightest = min(left[k] / limits[k] for k in left)
            rows.append((tightest, tenant, left))
        rows.sort()
        return [(t, k, v) for _, t, left in rows[:limit] for k, v in left.items()]

    # ---- what etcd says --------------------------------------------------------------------

    def pending(self) -> list[UsageEntry]:
        """This writer's records whose count changed since they were last taken, to publish
        (`unsent` puts back what could not be written)."""
        self._roll(self.clock())
        day = self.period.day
        out = [
            UsageEntry(self.writer, t, day, Used(*self.own[t].as_list()))
            for t in sorted(self.changed)
            if t in self.own
        ]
        self.changed.clear()
        return out

    def unsent(self, entries: Iterable[UsageEntry]) -> None:
        self.changed.update(e.tenant for e in entries)

    def resume(self, mine: Iterable[UsageEntry]) -> None:
        """Take up this writer's own published records (once, when it starts): what it
        counted before a restart counts on."""
        if self.resumed:
            return
        self.resumed = True
        self._roll(self.clock())
        for entry in mine:
            if entry.month < self.period.month:
                self._own_past.add(entry.key)
            else:
                self.own.setdefault(entry.tenant, Used()).add(entry.in_period(self.period))

    def replace_others(self, entries: Iterable[UsageEntry]) -> None:
        self.others = {}
        for e in entries:
            if e.writer != self.writer:
                self.others.setdefault(e.tenant, {})[e.writer] = e
        self._recount()

    def put_other(self, entry: UsageEntry) -> None:
        if entry.writer != self.writer:
            writers = self.others.setdefault(entry.tenant, {})
            old = writers.get(entry.writer)
            self._move(entry.tenant, old, entry)
            writers[entry.writer] = entry
            if old is not None and not entry.tenant.startswith("@") and entry.month == old.month:
                grown = entry.used.tokens_month - old.used.tokens_month
                self.share.served(entry.tenant, grown, self.clock())  # any writer's, for rates
            if self.elsewhere is not None and old is not None:
                self._served_elsewhere(old, entry)

    def put_waiting(self, writer: str, waiting: Waiting) -> None:
        """Another writer's waiting tenants (its own router's workers share theirs otherwise:
        workers/shared.py)."""
        if _router(writer) != self.router:
            self.share.put(writer, waiting, self.clock())

    def delete_waiting(self, writer: str) -> None:
        self.share.delete(writer)

    def waiting_update(self) -> dict[str, object] | bool | None:
        """What to write of this worker's waiting tenants now: its record while it has some
        (every round: a record not renewed goes stale at the others), None (delete it) when
        its queues emptied since it was written, False when there is nothing to say."""
        if waiting := self.waiting():
            return to_doc(waiting)
        return None if self.waiting_published else False

    def _served_elsewhere(self, old: UsageEntry, new: UsageEntry) -> None:
        """What another router served a tenant since its last record (not this router's
        other workers: their admission is this one's; not a key's own count)."""
        if (
            new.tenant.startswith("@")
            or _router(new.writer) == self.router
            or new.month != old.month
        ):
            return
        grown = new.used.tokens_month - old.used.tokens_month
        if grown > 0 and self.elsewhere is not None:
            self.elsewhere(new.tenant, grown)

    def delete_other(self, writer: str, tenant: str) -> None:
        writers = self.others.get(tenant)
        if writers is not None and (gone := writers.pop(writer, None)) is not None:
            self._move(tenant, gone, None)
            if not writers:
                del self.others[tenant]

    def _move(self, tenant: str, old: UsageEntry | None, new: UsageEntry | None) -> None:
        """A writer's record of `tenant` went from `old` to `new`: the tenant's kept sum
        follows (a tenant without a budget has none)."""
        theirs = self._theirs.get(tenant)
        if theirs is None:
            return
        if old is not None:
            gone = old.in_period(self.period)
            theirs.tokens_day = max(0.0, theirs.tokens_day - gone.tokens_day)
            theirs.tokens_month = max(0.0, theirs.tokens_month - gone.tokens_month)
            theirs.joules_day = max(0.0, theirs.joules_day - gone.joules_day)
        if new is not None:
            theirs.add(new.in_period(self.period))

    def set_budgets(self, budgets: Mapping[str, Budget]) -> None:
        """Every tenant's budget, replacing those known (keys' own budgets stay)."""
        keys_own = {s: b for s, b in self.budgets.items() if s.startswith("@")}
        self.budgets = keys_own | {t: b for t, b in budgets.items() if not b.empty}
        self._recount()

    def set_key_budgets(self, budgets: Mapping[str, Budget]) -> None:
        """Every API key's own budget (key id -> budget), replacing those known."""
        for scope in [s for s in self.budgets if s.startswith("@")]:
            if scope[1:] not in budgets:
                self.set_budget(scope, None)
        for kid, b in budgets.items():
            self.set_budget(key_scope(kid), b)

    def set_budget(self, tenant: str, b: Budget | None) -> None:
        if b is None or b.empty:
            self.budgets.pop(tenant, None)
            self._theirs.pop(tenant, None)
        else:
            self.budgets[tenant] = b
            self._theirs[tenant] = self._count(tenant)

    def past(self) -> list[str]:
        """The keys (<writer>/<tenant>) of records of a month that is over, every writer's:
        once when this writer starts and once a month (each router sweeps; deleting twice
        is harmless)."""
        month = self.period.month
        if self._swept == month:
            return []
        self._swept = month
        theirs = [e.key for ws in self.others.values() for e in ws.values() if e.month < month]
        mine, self._own_past = sorted(self._own_past), set()
        return theirs + mine


class LedgerObserver:
    """Charges each request's usage to its tenant when it ends; `tokens_per_joule(endpoint)`
    is None where the answering node's efficiency is not measured."""

    def __init__(self, ledger: Ledger, tokens_per_joule: Callable[[str], float | None]):
        self.ledger, self.tokens_per_joule = ledger, tokens_per_joule

    def observe(self, record: Record) -> None:
        if type(record) is not Ended or record.usage is None or not record.tenant:
            return None
        u = record.usage
        efficiency = self.tokens_per_joule(record.endpoint) if record.endpoint else None
        # NOTE: cgn-metrics measures output tokens per joule of the whole node: the energy of
        # a request's prompt is in it, so its joules are its output tokens over that figure
        joules = u.completion_tokens / efficiency if efficiency else 0.0
        tokens = u.prompt_tokens + u.completion_tokens
        self.ledger.charge(record.tenant, tokens, joules)
        key = key_scope(record.key_id)
        if record.key_id and key in self.ledger.budgets:  # a key with a budget of its own
            self.ledger.charge(key, tokens, joules)
        return None


async def publish(ledger: Ledger, etcd: EtcdSettings, publish_s: float) -> None:
    """Write this writer's changed records, at most every `publish_s`, and once more
    when the router stops (after its drain: the last requests count); delete the records
    of months that are over. A failed write is logged and tried again."""
    async with EtcdClient(etcd) as client:
        try:
            while True:
                await asyncio.sleep(publish_s)
                await _write(ledger, client)
        except asyncio.CancelledError:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_write(ledger, client), FINAL_WRITE_S)
            raise


TXN_OPS = 100  # records per etcd transaction (etcd's default limit is 128)


async def _write(
    ledger: Ledger, client: EtcdClient, prefix: str = keys.USAGE, waiting: str = keys.WAITING
) -> None:
    entries = ledger.pending()  # NOTE: what is left of it is unsent when a write fails
    update = ledger.waiting_update()
    ledger.share.forget(ledger.clock())
    try:
        while entries:
            batch = entries[:TXN_OPS]
            await client.txn([], [Op.put_json(prefix + e.key, e.to_json()) for e in batch])
            del entries[:TXN_OPS]
        gone = ledger.past()
        for at in range(0, len(gone), TXN_OPS):
            await client.txn([], [Op.delete(prefix + k) for k in gone[at : at + TXN_OPS]])
        if update is None:
            await client.delete(waiting + ledger.writer)
        elif update is not False:
            await client.put_json(waiting + ledger.writer, update)
        ledger.waiting_published = update not in (None, False)
    except CognitoraError as exc:  # etcd away (Unavailable) or refusing: the next round
        ledger.unsent(entries)
        if not ledger.failing:  # NOTE: once per outage, not once a second
            log.warning("usage ledger: could not publish (%s); trying every round", exc)
        ledger.failing = True
        return
    if ledger.failing:
        log.info("usage ledger: publishing again")
        ledger.failing = False
