"""Tenants' usage against their budgets, counted across every router (#58; cgn_core/budgets.py).

Each router worker is one writer. It counts what it serves (`LedgerObserver`, from
each request's `Ended`: prompt and completion tokens; joules where the node that
answered has a measured efficiency), publishes its count to etcd at most every
`publish_s` when it changed (`publish`), and follows every other writer's record
(followers.py). A tenant's usage is its own count plus the others' last records, so
several routers and workers hold one budget: a worker sees another's usage within
`publish_s` plus etcd's watch delay (one etcd round trip). A budget can therefore be
overrun by what the other writers served in that window, plus the requests in
flight when it was reached (each is charged when it ends).

A worker resumes from its own record when it starts (the usage is kept across a
restart); its writer name is `budgets.instance` (default: the host's name and the
OpenAI port) and its worker index, so a restarted router takes its record back up.
A record from a past month counts for nothing and is deleted by the next worker to
publish in the new month.
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
    UsageRecord,
    Used,
    exhausted,
    period,
    remaining,
    total,
)
from cgn_core.errors import CognitoraError, RateLimited
from cgn_core.etcd import EtcdClient
from cgn_core.settings import EtcdSettings
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


class Ledger:
    """This worker's count of each tenant's usage, the other writers' records, the budgets."""

    def __init__(self, writer: str, clock: Callable[[], float] = time.time):
        self.writer, self.clock = writer, clock
        self.period: Period = period(clock())
        self.own: dict[str, Used] = {}
        self.others: dict[str, UsageRecord] = {}  # writer -> its last record
        self.budgets: dict[str, Budget] = {}  # tenant -> its budget (tenants with one only)
        self.dirty = False  # own changed since the last publish
        self.resumed = False
        self._theirs: dict[str, Used] | None = None  # the others' total in this period

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
            self.own = {t: u for t, u in self.own.items() if u.tokens_month}
        self.period, self._theirs, self.dirty = p, None, True

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
        self.dirty = True

    def used(self, tenant: str) -> Used:
        """`tenant`'s usage in this period, over every writer."""
        self._roll(self.clock())
        if self._theirs is None:
            self._theirs = total(self.others.values(), self.period)
        out = Used()
        for part in (self.own.get(tenant), self._theirs.get(tenant)):
            if part is not None:
                out.add(part)
        return out

    def check(self, tenant: str) -> Exhausted | None:
        """The budget `tenant` has used up, if any (a tenant without a budget: None)."""
        b = self.budgets.get(tenant)
        if b is None:
            return None
        return exhausted(b, self.used(tenant), self.period)

    def admit(self, tenant: str) -> None:
        """RateLimited (429 `budget_exhausted`, Retry-After: until it resets) when `tenant`
        has used up a budget."""
        hit = self.check(tenant)
        if hit is not None:
            wait = max(1, int(hit.resets_unix - self.clock()) + 1)
            raise RateLimited(hit.message(tenant), code="budget_exhausted", retry_after_s=wait)

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

    def record(self) -> UsageRecord:
        """This writer's record, to publish."""
        self._roll(self.clock())
        p = self.period
        return UsageRecord(self.writer, p.day, p.month, self.clock(), dict(self.own))

    def resume(self, mine: UsageRecord) -> None:
        """Take up this writer's own published record (once, when it starts): what it counted
        before a restart counts on."""
        if self.resumed:
            return
        self.resumed = True
        self._roll(self.clock())
        for tenant, used in mine.in_period(self.period).items():
            self.own.setdefault(tenant, Used()).add(used)

    def replace_others(self, records: Mapping[str, UsageRecord]) -> None:
        self.others = {w: r for w, r in records.items() if w != self.writer}
        self._theirs = None

    def put_other(self, record: UsageRecord) -> None:
        if record.writer != self.writer:
            self.others[record.writer] = record
            self._theirs = None

    def delete_other(self, writer: str) -> None:
        if self.others.pop(writer, None) is not None:
            self._theirs = None

    def set_budgets(self, budgets: Mapping[str, Budget]) -> None:
        self.budgets = {t: b for t, b in budgets.items() if not b.empty}

    def set_budget(self, tenant: str, b: Budget | None) -> None:
        if b is None or b.empty:
            self.budgets.pop(tenant, None)
        else:
            self.budgets[tenant] = b

    def past(self) -> Iterable[str]:
        """The writers whose records are of a month that is over."""
        return [w for w, r in self.others.items() if r.month < self.period.month]


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
        self.ledger.charge(record.tenant, u.prompt_tokens + u.completion_tokens, joules)
        return None


async def publish(ledger: Ledger, etcd: EtcdSettings, publish_s: float) -> None:
    """Write this writer's record when it changed, at most every `publish_s`, and once more
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


async def _write(ledger: Ledger, client: EtcdClient) -> None:
    if not ledger.dirty:
        return
    ledger.dirty = False
    try:
        await client.put_json(keys.USAGE + ledger.writer, ledger.record().to_json())
        for writer in ledger.past():
            await client.delete(keys.USAGE + writer)
    except CognitoraError as exc:  # etcd away (Unavailable) or refusing: the next round
        ledger.dirty = True
        log.warning("usage ledger: could not publish (%s); trying again", exc)
