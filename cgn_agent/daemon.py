"""`cgn-agent run`: the I/O shell around the node agent.

Background work, all owned by one TaskGroup and cancelled at shutdown:
* supervision: every TICK_S, each runner polls its engine (exit, probes) and
  the agent reconciles runners with the placements;
* placements: list-then-watch of /cognitora/placements/<node>/;
* registration: a lease (lease_ttl_s) kept alive across etcd outages; the
  publisher pushes node, replica-status and endpoint keys under it, and
  re-sends all of them after any failure or with a new lease;
* inventory (every inventory_interval_s) and power (every power.interval_s).
Engines keep serving while etcd is away: nothing is stopped for lack of etcd.
SIGTERM/SIGINT set an event; by default the engines are left running for the
next agent to adopt (`engines.stop_on_exit` stops them instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cgn_agent import kvcached, processes
from cgn_agent.drivers import Launch, SystemToolbox, installed_engines
from cgn_agent.inventory import nvidia
from cgn_agent.inventory.collect import collect, run_command
from cgn_agent.inventory.types import Inventory
from cgn_agent.metrics import AgentCollector, registry_for
from cgn_agent.node import Invalid, NodeAgent, stray_engine_pids
from cgn_agent.power import POWERMETRICS_QUERY, PowerMeter, PowerReading, parse_powermetrics
from cgn_agent.power import rapl_zones as find_rapl_zones
from cgn_agent.publisher import Publisher
from cgn_agent.runner import Probed, RunnerContext
from cgn_agent.settings import AgentSettings
from cgn_agent.spec import ReplicaSpec, parse_placement
from cgn_agent.statefile import StateStore
from cgn_core import __version__, keys, pki
from cgn_core.backoff import Backoff
from cgn_core.engine_metrics import in_flight, name_map
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.etcd import EtcdClient, Lease, LeaseNotFound
from cgn_core.etcd.follow import list_and_watch
from cgn_core.etcd.local import free_port
from cgn_core.etcd.types import KeyValue, WatchEvent
from cgn_core.http import (
    Runner,
    bearer_header,
    error_middleware,
    loopback_middleware,
    mtls_middleware,
)
from cgn_core.keys import MAX_ADAPTERS, NAME
from cgn_core.nodeid import node_id, primary_address
from cgn_core.readiness import announce_ready, announce_stopping, bind_tcp
from cgn_core.revocation import RevocationList, follow_revocations
from cgn_core.tls import client_ssl_context, server_ssl_context, warn_if_plaintext

log = logging.getLogger(__name__)
TICK_S = 0.5
OPEN_ADMIN_PATHS = frozenset({"/healthz", "/metrics"})  # for probes and scrapers, no certificate


async def _tcp_probe(url: str, timeout_s: float) -> tuple[bool, bool, str]:
    """Ready once `tcp://host:port` accepts a connection (closed again at once)."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except (OSError, TimeoutError, ValueError) as exc:
        return False, False, f"{url}: {type(exc).__name__} {exc}".strip()
    writer.close()
    return True, True, ""


def listed_adapters(cards: list[dict[str, Any]], served: str) -> frozenset[str]:
    """The adapters a /v1/models page lists on `served` (vLLM's and cgn-infer's cards name
    it as `parent`): valid names only, at most MAX_ADAPTERS (the page is the engine's word)."""
    ids = (m.get("id") for m in cards if m.get("parent") == served)
    valid = (n for n in ids if isinstance(n, str) and NAME.match(n))
    return frozenset(itertools.islice(valid, MAX_ADAPTERS))


class HttpProber:
    """Readiness over HTTP: the health path answers 200, then /v1/models lists the model."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float):
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def probe(self, launch: Launch, served: str) -> Probed:
        if launch.probe == "tcp":
            return Probed(*await _tcp_probe(launch.url, self.timeout.total or 5.0))
        if launch.probe == "alive":  # a rank with no server of its own: alive is all it shows
            return Probed(True, True)
        try:
            async with self.session.get(launch.url + launch.health_path, timeout=self.timeout) as r:
                if r.status != 200:
                    return Probed(False, False, f"{launch.health_path} answered {r.status}")
            auth = bearer_header(launch.token)
            async with self.session.get(
                launch.url + launch.models_path, timeout=self.timeout, headers=auth
            ) as r:
                doc = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad JSON
            return Probed(False, False, f"{launch.url}: {type(exc).__name__} {exc}".strip())
        data = doc.get("data") if isinstance(doc, dict) else None
        cards = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if served not in {m.get("id") for m in cards}:
            return Probed(True, False, f"{launch.models_path} does not list {served!r}")
        return Probed(True, True, adapters=listed_adapters(cards, served))

    async def in_flight(self, launch: Launch) -> int | None:
        if launch.metrics_dialect is None:
            return None
        try:
            auth = bearer_header(launch.token)
            async with self.session.get(
                launch.url + "/metrics", timeout=self.timeout, headers=auth
            ) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            return None
        return in_flight(text, name_map(launch.metrics_dialect))


@dataclass
class Runtime:
    """What the loops share: the latest inventory and power, and whether etcd answers."""

    inventory: Inventory
    power: PowerReading = field(default_factory=lambda: PowerReading(None, "unknown"))
    revoked: RevocationList = field(default_factory=RevocationList)  # for the admin listener
    energy_j: float = 0.0
    etcd_ok: bool = False
    admin_url: str = ""
    _inventory_doc: tuple[Inventory, dict[str, Any]] | None = None

    def inventory_doc(self) -> dict[str, Any]:
        """The inventory as JSON, converted once per refresh (the node key is rebuilt each tick)."""
        if self._inventory_doc is None or self._inventory_doc[0] is not self.inventory:
            self._inventory_doc = (self.inventory, self.inventory.to_json())
        return self._inventory_doc[1]


def engine_addresses(bind: str, advertise: str, primary: Callable[[], str]) -> tuple[str, str]:
    """(where engines listen, the address the router is told). By default both are the
    advertised address (this machine's primary one unless set): engines are not reachable on
    interfaces nobody routes to. A wildcard bind must be asked for explicitly."""
    wildcard = bind in ("0.0.0.0", "::")
    adv = advertise or (bind if bind and not wildcard else primary())
    return (bind or adv), adv


def check_identity(settings: AgentSettings, node: str) -> None:
    """Refuse to start with a client certificate that etcd or our peers would refuse."""
    for what, tls in (("etcd.tls", settings.etcd.tls), ("admin_tls", settings.admin_tls)):
        if not tls.enabled or tls.cert_file is None:
            continue
        try:
            pki.verify(
                pki.load_cert(tls.cert_file),
                pki.load_cert(tls.ca_file),  # type: ignore[arg-type]
                usage="client" if what == "etcd.tls" else "server",
                node=node,
            )
        except pki.PkiError as exc:
            raise ConfigError(f"{what}.cert_file {tls.cert_file}: {exc.message}") from None


async def serve(settings: AgentSettings, ready_file: Path | None) -> None:
    node = node_id(settings.node_id, settings.state_dir)
    check_identity(settings, node)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tools = SystemToolbox()
    eh = settings.engines
    bind_host, advertise = engine_addresses(eh.bind_host, eh.advertise_host, primary_address)
    engines, inv = await _inventory(settings, node, tools, advertise)
    rt = Runtime(inv)
    publisher = Publisher()
    probe_ssl = client_ssl_context(eh.tls) if eh.tls.enabled else None
    connector = aiohttp.TCPConnector(ssl=probe_ssl or True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        EtcdClient(settings.etcd) as client,
    ):
        agent = _node_agent(settings, node, session, publisher, tools, bind_host, advertise, rt)
        store = _store_plan(settings, advertise)
        agent.kv_store, agent.kv_offload_gib = store.address, store.offload_gib
        agent.kv_token = store.client_token
        adopted = await agent.adopt_orphans()
        if rt.inventory.accelerators:
            await asyncio.to_thread(_stop_stray_engines, agent.own_pids())
        runner, port = await _start_admin(settings, agent, rt)
        scheme = "https" if settings.admin_tls.enabled else "http"
        rt.admin_url = f"{scheme}://{advertise}:{port}"
        _publish_node(publisher, node, agent, rt)
        log.info(
            "node %s: %d engine(s) adopted, engines installed: %s, admin on %s:%d",
            node,
            len(adopted),
            ", ".join(engines),
            settings.admin.host,
            port,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_supervise(agent, publisher, node, rt))
                tg.create_task(_follow_placements(client, agent, node))
                tg.create_task(follow_revocations(client, rt.revoked))
                tg.create_task(_register(client, publisher, settings.lease_ttl_s, rt))
                tg.create_task(_refresh_inventory(settings, agent, rt, engines))
                tg.create_task(_measure_power(settings, rt))
                _start_store(tg, settings, store, tools, bind_host, publisher, node)
                announce_ready(ready_file, f"node {node}", ports={"admin": port}, node=node)
                await stop.wait()
                raise _Stop
        except* _Stop:
            pass
        log.info("shutting down")
        announce_stopping()
        if eh.stop_on_exit:
            await _stop_engines(agent, publisher, client)
        await runner.cleanup()
    if ready_file is not None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(ready_file.unlink)


async def _inventory(
    settings: AgentSettings, node: str, tools: SystemToolbox, advertise: str
) -> tuple[list[str], Inventory]:
    """The engines this node offers (those installed of `engines.offer`) and its inventory."""
    engines = installed_engines(tools, settings.engines.offer)
    if missing := [e for e in settings.engines.offer if e not in engines]:
        log.warning("engines.offer names %s, not installed here", ", ".join(missing))
    inv = await asyncio.to_thread(
        collect, node, engines=engines, labels=settings.labels, address=advertise
    )
    return engines, inv


def _node_agent(
    settings: AgentSettings,
    node: str,
    session: aiohttp.ClientSession,
    publisher: Publisher,
    tools: SystemToolbox,
    bind_host: str,
    advertise: str,
    rt: Runtime,
) -> NodeAgent:
    """The agent of this node's replicas, before it adopts what a previous run left."""
    eh = settings.engines
    ctx = RunnerContext(
        node=node,
        publisher=publisher,
        store=StateStore(settings.state_dir),
        prober=HttpProber(session, eh.probe_timeout_s),
        policy=settings.supervisor,
        log_dir=settings.state_dir / "logs",
        advertise_url=lambda port: f"http://{advertise}:{port}",
        stop_grace_s=eh.stop_grace_s,
        probe_interval_s=eh.probe_interval_s,
    )
    agent = NodeAgent(
        node,
        ctx,
        tools,
        bind_host,
        lambda: rt.inventory,
        free_port,
        settings.model_dirs,
        eh.tls if eh.tls.enabled else None,
    )
    agent.advertise_host = advertise
    return agent


async def _stop_engines(agent: NodeAgent, publisher: Publisher, client: EtcdClient) -> None:
    """engines.stop_on_exit: the engines stop with the agent, their keys deleted (bounded)."""
    await agent.close()
    for key in list(publisher.desired):
        publisher.delete(key)
    with contextlib.suppress(CognitoraError, TimeoutError):
        async with asyncio.timeout(5):
            await publisher.flush(client, 0)


def _store_plan(settings: AgentSettings, advertise: str) -> kvcached.StorePlan:
    kv = settings.kvcached
    token = kv.events_token if kv.mode == "external" else kvcached.new_token()
    return kvcached.plan(kv, advertise, token, kvcached.secret_path(kv, settings.state_dir))


def _start_store(
    tg: asyncio.TaskGroup,
    settings: AgentSettings,
    store: kvcached.StorePlan,
    tools: SystemToolbox,
    bind_host: str,
    publisher: Publisher,
    node: str,
) -> None:
    """Run the node's KV store (mode run) or publish the one that runs (mode external)."""
    kv = settings.kvcached
    if store.record is None:
        return
    if kv.mode == "external":
        publisher.set(keys.KVCACHED + node, store.record)
        return
    exe = tools.which("cgn-kvcached") or "cgn-kvcached"
    ready = settings.state_dir / "kvcached.ready"
    tls = settings.engines.tls if settings.engines.tls.enabled else None
    command = kvcached.argv(kv, exe, bind_host, ready, tls, store.secret_file)
    tg.create_task(
        kvcached.supervise(
            command,
            store.record["events_token"],
            ready,
            settings.state_dir / "logs" / "kvcached.log",
            publisher,
            node,
            store.record,
        )
    )


class _Stop(Exception):
    """Ends the TaskGroup (cancelling every background task) at shutdown."""


async def _start_admin(
    settings: AgentSettings, agent: NodeAgent, rt: Runtime
) -> tuple[web.AppRunner, int]:
    collector = AgentCollector(
        agent, lambda: rt.inventory, lambda: (rt.power, rt.energy_j), lambda: rt.etcd_ok
    )
    registry = registry_for(collector)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node": agent.node, "etcd": rt.etcd_ok})

    async def replicas(_: web.Request) -> web.Response:
        doc = {r: agent.runners[r].status_doc() for r in agent.runners}
        doc |= {r: {"phase": "Failed", "reason": why} for r, (_, why) in agent.refused.items()}
        return web.json_response({"node": agent.node, "replicas": doc})

    async def inventory(_: web.Request) -> web.Response:
        return web.json_response(rt.inventory_doc())

    tls = settings.admin_tls
    guard = (
        mtls_middleware(OPEN_ADMIN_PATHS, rt.revoked)
        if tls.enabled
        else loopback_middleware(OPEN_ADMIN_PATHS)
    )
    app = web.Application(middlewares=[error_middleware(1 << 20), guard])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/replicas", replicas)
    app.router.add_get("/inventory", inventory)
    sock = bind_tcp(settings.admin.host, settings.admin.port)
    runner = Runner(app, idle_timeout_s=settings.admin.idle_timeout_s, access_log=None)
    await runner.setup()
    ssl_ctx = server_ssl_context(tls, client_cert="optional") if tls.enabled else None
    if ssl_ctx is None:
        warn_if_plaintext(log, "admin listener", tls)
    await web.SockSite(runner, sock, ssl_context=ssl_ctx).start()
    return runner, int(sock.getsockname()[1])


def _publish_node(publisher: Publisher, node: str, agent: NodeAgent, rt: Runtime) -> None:
    p = rt.power
    doc: dict[str, Any] = rt.inventory_doc() | {
        "running": agent.running(),
        "power": {
            "watts": p.watts,
            "source": p.source,
            "parts": dict(p.parts),
            "notes": list(p.notes),
        },
        "energy_j": round(rt.energy_j, 1),
        "agent_version": __version__,
        "admin_url": rt.admin_url,
    }
    publisher.set(keys.NODES + node, doc)


async def _supervise(agent: NodeAgent, publisher: Publisher, node: str, rt: Runtime) -> None:
    while True:
        started = time.monotonic()
        await agent.tick()
        _publish_node(publisher, node, agent, rt)
        await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - started)))


async def _follow_placements(client: EtcdClient, agent: NodeAgent, node: str) -> None:
    prefix = f"{keys.PLACEMENTS}{node}/"

    def parse(kv: KeyValue) -> tuple[str, ReplicaSpec | Invalid]:
        replica = kv.key[len(prefix) :]
        try:
            data = kv.json()
        except (ValueError, RecursionError) as exc:
            return replica, Invalid(f"placement {replica}: value is not JSON ({exc})")
        try:
            return replica, parse_placement(replica, data)
        except ValueError as exc:
            return replica, Invalid(str(exc))

    def on_list(kvs: list[KeyValue]) -> None:
        agent.set_placements(dict(parse(kv) for kv in kvs))

    def on_event(ev: WatchEvent) -> None:
        if ev.kind == "delete":
            agent.set_placement(ev.kv.key[len(prefix) :], None)
        else:
            agent.set_placement(*parse(ev.kv))

    await list_and_watch(client, prefix, on_list, on_event, asyncio.Event())


async def _register(client: EtcdClient, publisher: Publisher, ttl_s: int, rt: Runtime) -> None:
    """Hold a lease and keep etcd in step with the publisher, reconnecting forever."""
    backoff = Backoff(base=0.2, cap=5.0)
    while True:
        lease = Lease(client, ttl_s)
        try:
            await lease.grant()
        except CognitoraError as exc:
            rt.etcd_ok = False
            delay = backoff.next()
            log.warning("etcd: cannot register (%s); retrying in %.1fs", exc.message, delay)
            await asyncio.sleep(delay)
            continue
        publisher.resync = True
        in_contact = True
        try:
            while not lease.lost.is_set():
                if in_contact and not lease.connected:  # keep-alives failing: etcd is away
                    in_contact, rt.etcd_ok = False, False
                    publisher.resync = True  # when it returns, re-send every key
                    log.warning("etcd: unreachable; engines keep serving, reconnecting")
                try:
                    await publisher.flush(client, lease.id)
                except LeaseNotFound:
                    log.warning("etcd: lease %x is gone; registering again", lease.id)
                    break
                except CognitoraError as exc:
                    if rt.etcd_ok:
                        log.warning("etcd: %s; engines keep serving, retrying", exc.message)
                    rt.etcd_ok = False
                    await asyncio.sleep(backoff.next())
                    continue
                if lease.connected:
                    if not rt.etcd_ok:
                        sent = len(publisher.desired)
                        log.info("etcd: registered (lease %x); %d keys sent", lease.id, sent)
                    in_contact, rt.etcd_ok = True, True
                    backoff.reset()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await publisher.changed.wait()
        finally:
            await lease.close(revoke=False)


async def _refresh_inventory(
    settings: AgentSettings, agent: NodeAgent, rt: Runtime, engines: list[str]
) -> None:
    while True:
        await asyncio.sleep(settings.inventory_interval_s)
        rt.inventory = await asyncio.to_thread(
            collect,
            agent.node,
            engines=engines,
            own_pids=agent.own_pids(),
            labels=settings.labels,
            address=agent.advertise_host,
        )


async def _measure_power(settings: AgentSettings, rt: Runtime) -> None:
    zones, notes = find_rapl_zones()
    meter = PowerMeter(zones, notes)
    last = time.monotonic()
    while True:
        gpu_watts: dict[str, float | None] = {}
        if any(a.kind == "nvidia" for a in rt.inventory.accelerators):
            with contextlib.suppress(OSError, ValueError):
                gpus, _ = nvidia.parse_gpus(await asyncio.to_thread(run_command, nvidia.GPUS_QUERY))
                gpu_watts = {f"gpu{g.index}": g.power_w for g in gpus}
        apple = None
        if settings.power.powermetrics:
            with contextlib.suppress(OSError):
                apple = parse_powermetrics(await asyncio.to_thread(run_command, POWERMETRICS_QUERY))
        now = time.monotonic()
        rt.power = meter.read(now, gpu_watts, apple)
        if rt.power.watts is not None:
            rt.energy_j += rt.power.watts * (now - last)
        last = now
        await asyncio.sleep(settings.power.interval_s)


def _stop_stray_engines(own: list[int]) -> None:
    """SIGTERM engine processes holding our GPUs that no state record identifies."""
    try:
        apps = nvidia.parse_apps(run_command(nvidia.APPS_QUERY))
    except (OSError, ValueError) as exc:
        log.warning("cannot list GPU processes: %s", exc)
        return
    cmdlines = {a.pid: " ".join(processes.cmdline(a.pid)) for a in apps}
    for pid in stray_engine_pids(apps, own, cmdlines):
        log.warning("stopping unidentified engine pid %d holding a GPU: %s", pid, cmdlines[pid])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)


def run(settings: AgentSettings, ready_file: Path | None) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(settings, ready_file))
