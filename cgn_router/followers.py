"""What the router mirrors from etcd: one (prefix, on_list, on_event) entry per kind of record.

Endpoints, cordons, the nodes' KV stores (cgn-kvcached), the nodes' measured
efficiency (cgn-metrics), the catalog, the routing policy, (with auth on) API
keys, and (with budgets on) tenants' budgets and every router worker's count of
their usage. Every record is parsed by its
kind's validating function; a bad one is logged once per revision with its
key (`cgn_core.records.RecordLog`) and skipped, and the rest of the listing
still applies. The handlers are plain methods over the router's state, so
tests drive them with recorded key-values and no etcd;
`cgn_core.etcd.follow.list_and_watch` feeds them in the daemon, and contains
anything a handler still raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from cgn_core import keys
from cgn_core.apikeys import parse_record
from cgn_core.budgets import (
    WRITER_NAME,
    BudgetError,
    TenantRecord,
    UsageEntry,
    key_scope,
    parse_tenant,
    parse_usage,
    usage_key,
)
from cgn_core.etcd.types import KeyValue, WatchEvent
from cgn_core.records import KvStore, RecordLog, cordon, efficiency, kvcached
from cgn_router import fleetshare
from cgn_router.catalog import entry_from_etcd
from cgn_router.endpoint_records import endpoint_from_doc, endpoint_key_parts
from cgn_router.fleetshare import Waiting
from cgn_router.routing.chain import Policy, RoutingChain, chain_from_policy
from cgn_router.service import RouterService
from cgn_router.settings import RoutingSettings
from cgn_router.types import Endpoint, EndpointId

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Followed:
    prefix: str
    on_list: Callable[[list[KeyValue]], None]
    on_event: Callable[[WatchEvent], None]


class EtcdFollowers:
    """The router's etcd mirrors; `on_endpoints(eid)` runs after endpoint `eid` changed, or
    with None after anything that may change several (a list, a node store)."""

    def __init__(
        self,
        svc: RouterService,
        on_endpoints: Callable[[EndpointId | None], None] = lambda _: None,
    ):
        self.svc, self.on_endpoints = svc, on_endpoints
        self.records = RecordLog(log, on_bad=self._count_bad)

    def _count_bad(self, key: str) -> None:
        kind = key.removeprefix(keys.ROOT).split("/", 1)[0]  # endpoints, policy, catalog, …
        self.svc.metrics.records_ignored.labels(kind).inc()

    def table(self) -> list[Followed]:
        out = [
            Followed(keys.ENDPOINTS, self.endpoints_list, self.endpoints_event),
            Followed(keys.CORDON, self.cordon_list, self.cordon_event),
            Followed(keys.KVCACHED, self.stores_list, self.stores_event),
            Followed(keys.CATALOG, self.catalog_list, self.catalog_event),
            Followed(keys.POLICY_ROUTING, self.policy_list, self.policy_event),
            Followed(keys.EFFICIENCY, self.efficiency_list, self.efficiency_event),
        ]
        if self.svc.settings.auth.enabled:
            out.append(Followed(keys.API_KEYS, self.keys_list, self.keys_event))
        if self.svc.ledger is not None:
            out.append(Followed(keys.TENANTS, self.tenants_list, self.tenants_event))
            out.append(Followed(keys.USAGE, self.usage_list, self.usage_event))
            out.append(Followed(keys.WAITING, self.waiting_list, self.waiting_event))
        return out

    def _parse(self, kv: KeyValue, parse: Callable[[Any], T]) -> T | None:
        return self.records.parse(kv.key, kv.mod_revision, kv.value, parse)

    # ---- endpoints -------------------------------------------------------------------------

    def _endpoint(self, kv: KeyValue) -> Endpoint | None:
        return self._parse(kv, lambda doc: endpoint_from_doc(kv.key, doc))

    def endpoints_list(self, kvs: list[KeyValue]) -> None:
        parsed = [ep for kv in kvs if (ep := self._endpoint(kv)) is not None]
        for gone in self.svc.registry.replace_source("etcd", parsed):
            self.svc.proxy.withdraw(gone)
        self.on_endpoints(None)

    def endpoints_event(self, ev: WatchEvent) -> None:
        try:
            eid = endpoint_key_parts(ev.kv.key)[0]
        except ValueError:  # a key that never parses was never registered
            eid = None
        if ev.kind == "delete":
            if eid is not None:
                self.svc.registry.remove(eid)
                # NOTE: its engine is being drained or stopped: a tracked stream still on it
                # moves once it goes quiet (Proxy.withdraw), not after deadlines.idle_s
                self.svc.proxy.withdraw(eid)
        elif (ep := self._endpoint(ev.kv)) is not None:
            self.svc.registry.upsert(ep, "etcd")
        if eid is not None:
            self.on_endpoints(eid)

    # ---- node KV stores: the key names the node; the router follows each one's events -----

    def _store(self, kv: KeyValue) -> KvStore | None:
        return self._parse(kv, kvcached)

    def stores_list(self, kvs: list[KeyValue]) -> None:
        stores = {kv.key[len(keys.KVCACHED) :]: r for kv in kvs if (r := self._store(kv))}
        static = {n: (st.events_url, st.events_token) for n, st in self.svc.settings.stores.items()}
        self.svc.registry.stores = static | {
            n: (r.events_url, r.events_token) for n, r in stores.items() if n
        }
        self.on_endpoints(None)

    def stores_event(self, ev: WatchEvent) -> None:
        node, stores = ev.kv.key[len(keys.KVCACHED) :], self.svc.registry.stores
        if ev.kind == "delete" or (record := self._store(ev.kv)) is None:
            stores.pop(node, None)
            self.svc.registry.tiers.forget(node)
        elif node:
            stores[node] = (record.events_url, record.events_token)
        self.on_endpoints(None)

    # ---- cordons: the key names the node; the value must still be a valid cordon -----------

    # NOTE: a cordon whose value is unreadable still cordons: keeping traffic off a node
    # someone meant to cordon is the safe side. The value is checked only to report it.

    def cordon_list(self, kvs: list[KeyValue]) -> None:
        for kv in kvs:
            self._report_bad_cordon(kv)
        self.svc.registry.cordoned = {kv.key[len(keys.CORDON) :] for kv in kvs}

    def cordon_event(self, ev: WatchEvent) -> None:
        node, reg = ev.kv.key[len(keys.CORDON) :], self.svc.registry
        if ev.kind == "delete":
            reg.cordoned.discard(node)
        else:
            self._report_bad_cordon(ev.kv)
            reg.cordoned.add(node)

    def _report_bad_cordon(self, kv: KeyValue) -> None:
        if kv.value.strip():  # an empty value is a bare cordon, nothing to check
            self._parse(kv, cordon)

    # ---- node efficiency (cgn-metrics): the key names the node ---------------------------

    def efficiency_list(self, kvs: list[KeyValue]) -> None:
        self.svc.registry.efficiency = {
            kv.key[len(keys.EFFICIENCY) :]: doc
            for kv in kvs
            if (doc := self._parse(kv, efficiency)) is not None
        }

    def efficiency_event(self, ev: WatchEvent) -> None:
        node, known = ev.kv.key[len(keys.EFFICIENCY) :], self.svc.registry.efficiency
        if ev.kind == "delete" or (doc := self._parse(ev.kv, efficiency)) is None:
            known.pop(node, None)
        else:
            known[node] = doc

    # ---- catalog ---------------------------------------------------------------------------

    def _entry(self, kv: KeyValue) -> Any | None:
        name = kv.key[len(keys.CATALOG) :]
        return self._parse(kv, lambda doc: entry_from_etcd(name, doc))

    def catalog_list(self, kvs: list[KeyValue]) -> None:
        entries = {e.name: e for kv in kvs if (e := self._entry(kv)) is not None}
        self.svc.catalog.set_source("etcd", entries)

    def catalog_event(self, ev: WatchEvent) -> None:
        if ev.kind == "delete":
            self.svc.catalog.delete("etcd", ev.kv.key[len(keys.CATALOG) :])
        elif (entry := self._entry(ev.kv)) is not None:
            self.svc.catalog.put("etcd", entry)

    # ---- routing policy: the live chain (a bad value keeps the one in use) ------------

    def policy_list(self, kvs: list[KeyValue]) -> None:
        self.svc.chain = RoutingChain.from_settings(self.svc.settings.routing)
        for kv in kvs:
            if kv.key == keys.POLICY_ROUTING:
                self._policy(kv)

    def policy_event(self, ev: WatchEvent) -> None:
        if ev.kv.key != keys.POLICY_ROUTING:
            return
        if ev.kind == "delete":
            self.svc.chain = RoutingChain.from_settings(self.svc.settings.routing)
        else:
            self._policy(ev.kv)

    def _policy(self, kv: KeyValue) -> None:
        base = Policy.from_settings(self.svc.settings.routing)
        chain = self._parse(kv, lambda doc: chain_from_policy(doc, base))
        if chain is not None:
            self.svc.chain = chain
            log.info("routing policy from etcd: weights %s", chain.weights)

    # ---- API keys --------------------------------------------------------------------------

    def _key(self, kv: KeyValue) -> Any | None:
        return self._parse(kv, parse_record)

    def keys_list(self, kvs: list[KeyValue]) -> None:
        records = {
            kv.key[len(keys.API_KEYS) :]: r for kv in kvs if (r := self._key(kv)) is not None
        }
        self.svc.keys.replace(records)
        if self.svc.ledger is not None:
            self.svc.ledger.set_key_budgets({k: r.budget for k, r in records.items()})

    def keys_event(self, ev: WatchEvent) -> None:
        kid = ev.kv.key[len(keys.API_KEYS) :]
        record = None if ev.kind == "delete" else self._key(ev.kv)
        if record is not None:
            self.svc.keys.put(kid, record)
        else:  # revoked, or a record that no longer parses: refused from the next request on
            self.svc.keys.delete(kid)
        if self.svc.ledger is not None:
            self.svc.ledger.set_budget(key_scope(kid), record.budget if record else None)

    # ---- tenants' budgets, and every router worker's count of their usage (ledger.py) ------

    def _tenant(self, kv: KeyValue) -> TenantRecord | None:
        return self._parse(kv, lambda doc: parse_tenant(doc, kv.key[len(keys.TENANTS) :]))

    def tenants_list(self, kvs: list[KeyValue]) -> None:
        assert self.svc.ledger is not None
        self.svc.ledger.set_budgets({r.tenant: r.budget for kv in kvs if (r := self._tenant(kv))})

    def tenants_event(self, ev: WatchEvent) -> None:
        assert self.svc.ledger is not None
        record = None if ev.kind == "delete" else self._tenant(ev.kv)
        # NOTE: a record that no longer parses drops its budget (logged): a typo in a budget
        # must not refuse a tenant's every request
        budget = record.budget if record is not None else None
        self.svc.ledger.set_budget(ev.kv.key[len(keys.TENANTS) :], budget)

    def _usage(self, kv: KeyValue) -> UsageEntry | None:
        return self._parse(kv, lambda doc: parse_usage(doc, kv.key[len(keys.USAGE) :]))

    def usage_list(self, kvs: list[KeyValue]) -> None:
        ledger = self.svc.ledger
        assert ledger is not None
        parsed = [e for kv in kvs if (e := self._usage(kv)) is not None]
        ledger.resume(e for e in parsed if e.writer == ledger.writer)  # before a restart
        ledger.replace_others(parsed)

    def usage_event(self, ev: WatchEvent) -> None:
        ledger = self.svc.ledger
        assert ledger is not None
        if ev.kind == "delete" or (entry := self._usage(ev.kv)) is None:
            try:
                writer, tenant = usage_key(ev.kv.key[len(keys.USAGE) :])
            except BudgetError:  # a key that never parses was never counted
                return
            ledger.delete_other(writer, tenant)
        else:
            ledger.put_other(entry)

    # ---- who waits at the other routers (fleetshare.py) ------------------------------------

    def _waiting(self, kv: KeyValue) -> tuple[str, Waiting] | None:
        def parsed(doc: Any) -> tuple[str, Waiting]:
            writer = kv.key[len(keys.WAITING) :]
            if not WRITER_NAME.match(writer):
                raise ValueError(f"waiting record key {writer[:80]!r}: want <writer>")
            return writer, fleetshare.parse(doc)

        return self._parse(kv, parsed)

    def waiting_list(self, kvs: list[KeyValue]) -> None:
        ledger = self.svc.ledger
        assert ledger is not None
        ledger.share.theirs.clear()
        for kv in kvs:
            if (got := self._waiting(kv)) is not None:
                ledger.put_waiting(*got)

    def waiting_event(self, ev: WatchEvent) -> None:
        ledger = self.svc.ledger
        assert ledger is not None
        if ev.kind == "delete" or (got := self._waiting(ev.kv)) is None:
            ledger.delete_waiting(ev.kv.key[len(keys.WAITING) :])
        else:
            ledger.put_waiting(*got)


def routing_policy(doc: Any) -> RoutingChain:
    """The chain a policy value asks for over the default settings (for the poison tests)."""
    return chain_from_policy(doc, Policy.from_settings(RoutingSettings()))
