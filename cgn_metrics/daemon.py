"""`cgn-metrics serve`: discover, scrape, summarize, serve; until SIGTERM.

Each round (every `scrape_interval_s`): the fleet is read from etcd (with
discovery `etcd`; when etcd does not answer, the last fleet is kept and the page
says so), every target's /metrics is scraped, the fleet view is recomputed and
its scalars appended to the history rings; the file_sd list is rewritten when
the targets changed. A round that fails is logged and the next one runs: no
target, record or etcd outage stops the loop, and /health says when the loop
itself has not completed a round for three intervals.

Memory: each kept series of each target holds window_s / scrape_interval_s + 2
points, each history series retention_s / scrape_interval_s points (720 by
default), 16 bytes a point: about 12 KiB per history series and 0.2 KiB per
target series (100 engines of ~200 kept series each: ~4 MiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from cgn_core import keys
from cgn_core.errors import CognitoraError
from cgn_core.etcd.client import EtcdClient
from cgn_core.fleet_view import FleetView
from cgn_core.readiness import announce_ready, announce_stopping
from cgn_core.records import Efficiency, RecordLog
from cgn_core.tls import client_ssl_context
from cgn_metrics.fleet import summarize
from cgn_metrics.monitor import Monitor
from cgn_metrics.scrape import Scraper
from cgn_metrics.server import start_http
from cgn_metrics.settings import MetricsSettings
from cgn_metrics.targets import Fleet, fleet_from_records, static_targets

log = logging.getLogger(__name__)


async def read_fleet(client: EtcdClient, rec: RecordLog) -> Fleet:
    async def prefix(p: str) -> dict[str, bytes]:
        kvs, _ = await client.get_prefix(p)
        return {kv.key: kv.value for kv in kvs}

    nodes, endpoints, kvcached, cordons, placements, scaling = await asyncio.gather(
        prefix(keys.NODES),
        prefix(keys.ENDPOINTS),
        prefix(keys.KVCACHED),
        prefix(keys.CORDON),
        prefix(keys.PLACEMENTS),
        prefix(keys.SCALING),
    )
    placed = {k.removeprefix(keys.PLACEMENTS).partition("/")[0] for k in placements}
    return fleet_from_records(nodes, endpoints, kvcached, cordons, placed, rec, scaling=scaling)


def efficiency_records(view: FleetView, now_unix: float) -> dict[str, dict[str, Any]]:
    """The `/cognitora/efficiency/<node>` records of a view: measured nodes only."""
    return {
        keys.EFFICIENCY + n.node: Efficiency(
            n.tokens_per_joule, round(now_unix, 3), n.source, view.window_s
        ).to_json()
        for n in view.nodes
        if n.tokens_per_joule and n.node
    }


async def publish_efficiency(etcd: EtcdClient, view: FleetView) -> None:
    for key, doc in efficiency_records(view, time.time()).items():
        await etcd.put_json(key, doc)


async def run_loop(monitor: Monitor, scraper: Scraper, etcd: EtcdClient | None) -> None:
    s = monitor.settings
    rec = RecordLog(log)
    published = 0.0
    while True:
        started = time.monotonic()
        try:
            if etcd is not None:
                try:
                    monitor.fleet = await asyncio.wait_for(read_fleet(etcd, rec), s.etcd.timeout_s)
                    monitor.etcd_error = ""
                except (TimeoutError, OSError, CognitoraError) as exc:
                    monitor.etcd_error = (
                        f"etcd did not answer ({type(exc).__name__}); showing the last fleet read"
                    )
            targets = [*monitor.static, *monitor.fleet.targets]
            scraper.set_targets(targets)
            await scraper.round()
            view = summarize(monitor.fleet, scraper.scraped, time.time(), s.window_s)
            view = replace(view, etcd_error=monitor.etcd_error)
            monitor.record(view)
            await asyncio.to_thread(monitor.write_file_sd, targets)
            due = s.efficiency_publish_s and time.monotonic() - published >= s.efficiency_publish_s
            if etcd is not None and due and not monitor.etcd_error:
                published = time.monotonic()
                try:
                    await publish_efficiency(etcd, view)
                except (OSError, CognitoraError) as exc:  # read-only role, etcd gone: next time
                    log.warning("could not publish node efficiencies: %s", exc)
        except Exception:  # NOTE: top of the loop: one bad round must not stop the page
            log.exception("a scrape round failed")
        await asyncio.sleep(max(0.0, s.scrape_interval_s - (time.monotonic() - started)))


async def serve(settings: MetricsSettings, ready_file: Path | None) -> None:

    static = static_targets(settings.targets)  # checked with the settings
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    monitor = Monitor(settings, static)
    verify: Any = client_ssl_context(settings.tls) if settings.tls.enabled else True
    capacity = int(settings.window_s / settings.scrape_interval_s) + 2
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                timeout=settings.scrape_timeout_s,
                verify=verify,
                limits=httpx.Limits(max_connections=settings.scrape_concurrency),
            )
        )
        etcd = None
        if settings.discovery == "etcd":
            etcd = await stack.enter_async_context(EtcdClient(settings.etcd))
        scraper = Scraper(
            client,
            timeout_s=settings.scrape_timeout_s,
            concurrency=settings.scrape_concurrency,
            capacity=capacity,
        )
        monitor.scraped = scraper.scraped
        runner, port = await start_http(settings, monitor)
        stack.push_async_callback(runner.cleanup)
        loop_task = asyncio.create_task(run_loop(monitor, scraper, etcd))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info(
            "cgn-metrics on http://%s:%d (discovery %s, %d static targets)",
            settings.http.host,
            port,
            settings.discovery,
            len(static),
        )
        announce_ready(ready_file, f"serving on port {port}", ports={"http": port})
        await stop.wait()
        announce_stopping()
        loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop_task


def run(settings: MetricsSettings, ready_file: Path | None) -> None:
    asyncio.run(serve(settings, ready_file))
