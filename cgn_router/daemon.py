"""`cgn-router serve`: wire the pieces, follow etcd, scrape engines, follow KV events.

Background work, all owned by one TaskGroup and cancelled at shutdown:
* one list-then-watch task per etcd prefix (endpoints, cordon, catalog, policy);
* one scraper that reads every endpoint's /metrics each `scrape.interval_s`;
* one KV-event follower per endpoint that publishes events.
SIGTERM/SIGINT set an event; shutdown stops accepting, lets requests in flight
finish for up to `deadlines.total_s` (at most 30 s), then cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from cgn_control.loop import ControlState, run_reconciler
from cgn_core.cli import EXIT_USAGE, fail
from cgn_core.errors import ConfigError
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.follow import list_and_watch
from cgn_core.http import Runner, bearer_header
from cgn_core.process import raise_fd_limit, usable_cores
from cgn_core.readiness import announce_ready, announce_stopping, bind_tcp
from cgn_core.revocation import follow_revocations
from cgn_core.settings import ListenSettings
from cgn_core.tls import client_ssl_context, server_ssl_context, warn_if_plaintext
from cgn_core.tracing import SpanCounts, Tracer
from cgn_router.adapters import RUNTIME_LORA_ENGINES
from cgn_router.admin import build_admin_app
from cgn_router.auth import Limiter
from cgn_router.catalog import Catalog, entry_from_settings
from cgn_router.endpoint_records import endpoint_from_static
from cgn_router.fleetshare import STALE_PERIODS
from cgn_router.followers import EtcdFollowers
from cgn_router.gate import Gate
from cgn_router.kv_follow import KvFollowers
from cgn_router.ledger import Ledger, publish, writer_name
from cgn_router.metrics import RouterMetrics
from cgn_router.proxy import Proxy
from cgn_router.registry import Registry
from cgn_router.routing.chain import RoutingChain
from cgn_router.routing.kv_index import PrefixIndex, TierIndex
from cgn_router.routing.lifecycle import Observer
from cgn_router.scrape import adapter_slots, engine_load, loaded_adapters, name_map
from cgn_router.server import build_front
from cgn_router.service import RouterService
from cgn_router.sessions import Sessions
from cgn_router.settings import RouterSettings, ScrapeSettings
from cgn_router.types import EndpointId
from cgn_router.upstream import Upstream
from cgn_router.workers.shared import SharedLoad, SharedSpeed, SharedUsage
from cgn_router.workers.supervisor import Heartbeat, Supervisor, WorkerRole

log = logging.getLogger(__name__)
DRAIN_CAP_S = 30.0
UPSTREAM_IDLE_S = 10.0  # a pooled upstream connection idle this long is closed
MAX_METRICS_PAGE = 4 << 20  # an engine's /metrics beyond this is cut (vLLM's is ~100 KiB)


def build_service(
    settings: RouterSettings,
    upstream: Upstream,
    worker: WorkerRole | None = None,
    observers: tuple[Observer, ...] = (),
) -> RouterService:
    """Every object the router runs on, from its settings (no I/O); a worker of several
    counts with the others (shared.py) and has its share of the index's memory budget.
    `observers` see every request's records besides the metrics and load signals."""
    r = settings.routing
    workers = worker.count if worker else 1
    try:
        chain = RoutingChain.from_settings(r)
    except ValueError as exc:
        raise ConfigError(f"routing: {exc}") from None
    budget = r.index_budget_bytes() // workers  # 3/4 for engines' blocks, 1/4 for stores'
    index = PrefixIndex(r.approx_ttl_s, r.approx_blocks, r.optimistic_ttl_s, budget * 3 // 4)
    sessions = Sessions(r.session_ttl_s)
    tiers = TierIndex(budget // 4)
    load = SharedLoad(worker.load_fd, worker.count, worker.index) if worker else None
    ledger = None  # tenants' budgets need etcd: where usage is published and budgets kept
    if settings.budgets.enabled and settings.discovery == "etcd":
        me = worker.index if worker else 0
        ledger = Ledger(writer_name(settings.budgets, settings.http.port, me))
    speeds = SharedSpeed(worker.speed_fd, worker.count, worker.index) if worker else None
    registry = Registry(
        settings.breaker, index, sessions, settings.scrape.stale_s, tiers, load, speeds
    )
    metrics = RouterMetrics()
    metrics.watch(registry)
    svc = RouterService(
        settings,
        Catalog(r.chars_per_block, r.prompt_cache_mib),
        registry,
        chain,
        Proxy(upstream, settings.deadlines, settings.max_response_bytes),
        metrics,
        limiter=Limiter(shared=SharedUsage(worker.usage_fd, worker.count, worker.index))
        if worker
        else Limiter(),
        ledger=ledger,
        observers=observers,
    )
    metrics.watch_scaling(lambda: svc.control)
    metrics.watch_prompts(lambda: svc.catalog.prompts.used)
    if ledger is not None:
        metrics.watch_budgets(ledger.remaining_rows)
    if settings.admission.enabled:
        svc.gate = Gate(settings.admission, registry, metrics, load)
        if ledger is not None and (worker is None or worker.index == 0):
            ledger.elsewhere = svc.gate.served_elsewhere  # fairness across routers
        if ledger is not None:  # every worker: who waits at other routers, and their rates
            svc.gate.share_with(ledger, STALE_PERIODS * settings.budgets.publish_s)
    try:
        static = [endpoint_from_static(name, e) for name, e in settings.endpoints.items()]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    registry.replace_source("static", static)
    for node, store in settings.stores.items():
        if not node or not store.events_url.startswith(("http://", "https://")):
            raise ConfigError(f"stores.{node}.events_url must be an http(s) URL")
        registry.stores[node] = (store.events_url, store.events_token)
    return svc


async def serve(
    settings: RouterSettings, ready_file: Path | None, worker: WorkerRole | None = None
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The proxy's requests go through the lean upstream client (upstream.py); this session
    # serves the background work only: metrics scrapes and KV event streams.
    # NOTE: no cookie jar: one client's upstream cookies must never ride along on another's
    # requests. The upstream client keeps none either.
    # NOTE: idle connections are dropped after UPSTREAM_IDLE_S, before an engine's own idle
    # timeout (http.idle_timeout_s, 15 s by default) closes them under a request being sent.
    engine_ssl = client_ssl_context(settings.engine_tls) if settings.engine_tls.enabled else None
    async with (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=UPSTREAM_IDLE_S, ssl=engine_ssl or True
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        ) as session,
        Upstream(keepalive_s=UPSTREAM_IDLE_S, tls=engine_ssl) as upstream,
    ):
        svc = build_service(settings, upstream, worker)
        await _prepare(svc, worker)
        listeners = _Listeners(svc, worker)
        admin = await listeners.admin()
        if worker is None:
            await listeners.openai()
        picker = await listeners.picker()
        _log_start(settings, worker, listeners.ports)
        try:
            async with asyncio.TaskGroup() as tg:
                _background(svc, session, tg, worker)
                if worker is not None:
                    # NOTE: a worker joins the shared port once it knows the keys and the
                    # fleet: before, the kernel would hand it connections it must refuse
                    await svc.in_sync.wait()
                    await listeners.openai()
                ports = listeners.ports
                announce_ready(ready_file, f"serving on port {ports['http']}", ports=ports)
                await stop.wait()
                log.info("shutting down: draining requests in flight")
                announce_stopping()
                # NOTE: the OpenAI listener closes and drains first, the admin one last:
                # /metrics and /healthz answer through the drain
                await listeners.front.shutdown(listeners.drain_s)
                if picker is not None:
                    await picker.stop(listeners.drain_s)
                await admin.cleanup()
                raise _Stop
        except* _Stop:
            pass
        if svc.tracer is not None:
            await asyncio.to_thread(svc.tracer.close)  # what is queued goes out, bounded
        if ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(ready_file.unlink)


async def _prepare(svc: RouterService, worker: WorkerRole | None) -> None:
    """Tracing, and the catalog's models loaded (requests hash exactly from the first)."""
    settings = svc.settings
    if settings.tracing.enabled:
        instance = f"worker-{worker.index}" if worker is not None else ""
        svc.tracer = Tracer(settings.tracing, "cgn-router", instance)
        svc.metrics.registry.register(SpanCounts(svc.tracer, "cgn_router"))
    svc.catalog.set_source(
        "settings", {n: entry_from_settings(n, m) for n, m in settings.models.items()}
    )
    await svc.catalog.wait_loaded()


class _Listeners:
    """The OpenAI listener (the front) and the admin one, and the ports they got."""

    def __init__(self, svc: RouterService, worker: WorkerRole | None):
        self.svc, self.worker = svc, worker
        self.front = build_front(svc)
        self.drain_s = min(DRAIN_CAP_S, svc.settings.deadlines.total_s)
        self.ports: dict[str, int] = {}

    def _bind(self, name: str, where: ListenSettings) -> socket.socket:
        sock = bind_tcp(where.host, where.port, reuse_port=self.worker is not None)
        self.ports[name] = sock.getsockname()[1]
        return sock

    async def admin(self) -> Runner:
        settings, worker = self.svc.settings, self.worker
        sock = self._bind("admin", settings.admin)
        runner = Runner(
            build_admin_app(self.svc, worker),
            idle_timeout_s=settings.admin.idle_timeout_s,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.drain_s,
        )
        await runner.setup()
        # NOTE: a secondary worker's admin listener is loopback, for the primary's /metrics
        private = worker is not None and not worker.primary
        ssl_ctx = None if private else _listener_ssl("admin", settings)
        await web.SockSite(runner, sock, ssl_context=ssl_ctx).start()
        return runner

    async def picker(self) -> Any:
        """The endpoint picker (epp.py), where enabled: its servers, to stop at the end."""
        settings = self.svc.settings
        if not settings.epp.enabled:
            return None
        from cgn_router import epp  # gRPC and Envoy's stubs: loaded where the picker runs

        if not settings.epp_tls.enabled:
            warn_if_plaintext(log, "endpoint picker (ext_proc)", settings.epp_tls)
        picker, self.ports["epp"], self.ports["epp_health"] = await epp.serve(
            self.svc, settings.epp, settings.epp_tls
        )
        return picker

    async def openai(self) -> None:
        settings = self.svc.settings
        await self.front.start(self._bind("http", settings.http), _listener_ssl("http", settings))


def _log_start(settings: RouterSettings, worker: WorkerRole | None, ports: dict[str, int]) -> None:
    log.info(
        "OpenAI API on %s:%d, admin on %s:%d",
        settings.http.host,
        settings.http.port if worker else ports["http"],
        settings.admin.host,
        ports["admin"],
    )
    if settings.tls.cert_file is None:
        warn_if_plaintext(log, "OpenAI API", settings.tls)
    if not settings.auth.enabled:
        log.warning(
            "API authentication is OFF (auth.enabled: false): every client is tenant %r "
            "in band %r; fine for development only",
            settings.auth.anonymous_tenant,
            settings.auth.anonymous_band,
        )


def _background(
    svc: RouterService,
    session: aiohttp.ClientSession,
    tg: asyncio.TaskGroup,
    worker: WorkerRole | None,
) -> None:
    """The router's background tasks, in `tg`: its heartbeat (a worker), the engines'
    metrics scrapes, admission, etcd's fleet and the reconciler, the KV event streams."""
    settings = svc.settings
    follower = KvFollowers(svc, session, tg)
    if worker is not None:  # the supervisor replaces a worker whose loop stops
        tg.create_task(Heartbeat(worker.beat_fd, worker.count).run(worker.index))
    tg.create_task(_scrape_loop(svc, session))
    if svc.gate is not None:
        tg.create_task(svc.gate.run())
    if settings.discovery == "etcd":
        tg.create_task(_follow_etcd(svc, follower, tg))
        if settings.reconciler.enabled:
            svc.control = ControlState()
            tg.create_task(_control(svc, svc.control))
    else:
        svc.in_sync.set()
    follower.reconcile()


class _Stop(Exception):
    """Ends the TaskGroup (cancelling every background task) at shutdown."""


def _listener_ssl(name: str, settings: RouterSettings) -> ssl.SSLContext | None:
    """HTTPS for the OpenAI surface when a certificate is set (clients present none); HTTPS
    for the admin listener with client certificates checked per call (mtls_middleware)."""
    if name == "http":
        if settings.tls.cert_file is None:
            return None
        return server_ssl_context(settings.tls, client_cert="none")
    if not settings.admin_tls.enabled:
        warn_if_plaintext(log, "admin listener", settings.admin_tls)
        return None
    return server_ssl_context(settings.admin_tls, client_cert="optional")


# ---- etcd --------------------------------------------------------------------


async def _follow_etcd(svc: RouterService, follower: KvFollowers, tg: asyncio.TaskGroup) -> None:
    client = EtcdClient(svc.settings.etcd)
    table = EtcdFollowers(svc, on_endpoints=follower.reconcile).table()
    listed = {f.prefix: asyncio.Event() for f in table}
    for f in table:
        tg.create_task(list_and_watch(client, f.prefix, f.on_list, f.on_event, listed[f.prefix]))
    tg.create_task(follow_revocations(client, svc.revoked))
    if svc.ledger is not None:
        tg.create_task(publish(svc.ledger, svc.settings.etcd, svc.settings.budgets.publish_s))
    try:
        await asyncio.gather(*(e.wait() for e in listed.values()))
        svc.in_sync.set()
        log.info("registry synced from etcd: %d endpoints", len(svc.registry.states))
        await asyncio.Event().wait()  # the client lives as long as the watches
    finally:
        await client.close()


async def _control(svc: RouterService, state: ControlState) -> None:
    async with EtcdClient(svc.settings.etcd) as client:
        await run_reconciler(client, svc.settings.reconciler, state, svc.load.signals)


# ---- engines: metrics and KV events -------------------------------------------


async def _scrape_loop(svc: RouterService, session: aiohttp.ClientSession) -> None:
    interval = svc.settings.scrape.interval_s
    timeout = aiohttp.ClientTimeout(total=max(0.2, min(interval, svc.settings.scrape.stale_s / 2)))

    async def scrape_one(eid: EndpointId) -> None:
        state = svc.registry.states.get(eid)
        if state is None:
            return
        try:
            async with session.get(
                state.endpoint.url + "/metrics",
                timeout=timeout,
                headers=bearer_header(state.endpoint.token),
            ) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                page = await resp.content.read(MAX_METRICS_PAGE)
        except (aiohttp.ClientError, TimeoutError) as exc:
            state.scrape_error = str(exc) or type(exc).__name__
            svc.registry.requeue(state, time.monotonic())  # its figures may be stale now
            return
        text = page.decode("utf-8", "replace")  # the page is the engine's word: never trusted
        load = engine_load(text, name_map(state.endpoint.engine), time.monotonic())
        if load is not None:
            load = replace(load, own_in_flight=state.in_flight)
        state.load, state.scrape_error = load, "" if load else "no load metrics on the page"
        if state.endpoint.engine in RUNTIME_LORA_ENGINES:  # what it holds now (#60)
            state.adapters = loaded_adapters(text)
            state.adapter_slots = adapter_slots(text)
        svc.registry.requeue(state, time.monotonic())

    while True:  # one pass: every endpoint once, in even slices over the pass's period
        eids = list(svc.registry.states)
        period, slices = scrape_plan(len(eids), svc.settings.scrape)
        svc.registry.stale_s = max(svc.settings.scrape.stale_s, 2 * period)
        started = time.monotonic()
        for k in range(slices):
            part = eids[k * len(eids) // slices : (k + 1) * len(eids) // slices]
            await asyncio.gather(*(scrape_one(eid) for eid in part))
            await asyncio.sleep(max(0.0, started + (k + 1) * period / slices - time.monotonic()))


SCRAPE_SLICE_S = 0.1  # a pass's scrapes go out in slices this far apart, not in one burst


def scrape_plan(endpoints: int, s: ScrapeSettings) -> tuple[float, int]:
    """(period of one pass over `endpoints`, slices it is sent in): every `interval_s`, or
    slower when that would exceed `max_per_s` scrapes a second; the load figures are then
    trusted for twice the period (a fleet of thousands is scraped less often, not slower)."""
    period = max(s.interval_s, endpoints / s.max_per_s)
    return period, max(1, min(endpoints, round(period / SCRAPE_SLICE_S)))


def run(
    settings: RouterSettings,
    ready_file: Path | None,
    *,
    worker: WorkerRole | None = None,
    source: tuple[Path | None, dict[str, str]] = (None, {}),
) -> None:
    """Serve: this process alone, or (settings.workers != 1, not a worker already) a
    supervisor of that many worker processes, each given `source` (config file, flags)."""
    count = settings.workers or usable_cores()
    if worker is None and count > 1:
        config, flags = source
        try:
            build_service(settings, Upstream())  # a settings mistake is said once, here
            supervisor = Supervisor(count, config, flags, ready_file)
            code = supervisor.run(
                settings.http.host, settings.http.port, settings.admin.host, settings.admin.port
            )
        except ConfigError as exc:
            fail(exc.message, EXIT_USAGE)
        raise SystemExit(code)
    raise_fd_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # not on every platform
        pass
    asyncio.run(serve(settings, ready_file, worker))
