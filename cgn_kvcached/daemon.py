"""`cgn-kvcached serve`: the block store behind its gRPC service, until SIGTERM.

Start-up: settings checked (budgets, the SSD directory writable), the node
secret read (cgn_core/kv/identity.py), the SSD index rebuilt from its
directory, the gRPC listener bound (mutual TLS with the cluster CA when `tls`
is set, plaintext otherwise, logged), then the ready file and systemd's
READY=1. Shutdown stops accepting and lets calls in flight finish for a few
seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cgn_core.errors import ConfigError
from cgn_core.files import open_dir_safely
from cgn_core.http import Runner, bearer_middleware, error_middleware, serve_sse
from cgn_core.kv.identity import StoreKeys, read_secret
from cgn_core.kv.ram_tier import RamTier
from cgn_core.kv.service import KvCacheService, start_server
from cgn_core.kv.ssd_tier import UNSEALED, SsdTier
from cgn_core.kv.store import BlockStore
from cgn_core.readiness import announce_ready, announce_stopping, bind_tcp
from cgn_core.tracing import SpanCounts, Tracer
from cgn_kvcached.metrics import registry_for
from cgn_kvcached.settings import KvcachedSettings

log = logging.getLogger(__name__)
GRACE_S = 5.0
OPEN_ADMIN_PATHS = frozenset({"/metrics", "/healthz"})


def prepare_shm_dir(directory: Path | None) -> Path | None:
    """The shared-memory transfer directory, private to this user; None if unusable.

    NOTE: it usually lives in a sticky world-writable parent (/dev/shm) where anyone may
    have planted its name, or a parent's, first: it is created, or opened, one component at
    a time following no link another user could have made (files.open_dir_safely), must be
    a directory this user owns, and only then made 0700 (through the open descriptor)."""
    if directory is None:
        return None
    try:
        fd = open_dir_safely(directory)
    except OSError as exc:
        why = str(exc) if exc.errno == errno.ELOOP else exc.strerror
        log.warning("shared memory off: shm_dir %s: %s", directory, why)
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            log.warning("shared memory off: shm_dir %s belongs to uid %d", directory, st.st_uid)
            return None
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return directory


def load_keys(s: KvcachedSettings) -> StoreKeys | None:
    if s.secret_file is None:
        log.warning(
            "no secret_file: any local process may read and write this store's blocks "
            "(development only; cgn-agent and cgn-ctl up always set one)"
        )
        return None
    return StoreKeys.derive(read_secret(s.secret_file))


def build_store(s: KvcachedSettings, keys: StoreKeys | None) -> BlockStore:
    ssd = None
    if s.ssd_dir is not None:
        try:
            ssd = SsdTier(Path(s.ssd_dir), s.ssd_bytes, keys.seal_key if keys else UNSEALED)
        except OSError as exc:
            raise ConfigError(f"ssd_dir {s.ssd_dir}: {exc.strerror}") from None
    return BlockStore(RamTier(s.ram_bytes), ssd, write_through=s.write_through)


async def serve(settings: KvcachedSettings, ready_file: Path | None) -> None:
    keys = await asyncio.to_thread(load_keys, settings)
    store = await asyncio.to_thread(build_store, settings, keys)
    tls = settings.tls
    shm_dir = await asyncio.to_thread(prepare_shm_dir, settings.shm_dir)
    tracer = Tracer(settings.tracing, "cgn-kvcached") if settings.tracing.enabled else None
    service = KvCacheService(store, shm_dir=shm_dir, keys=keys, tracer=tracer)
    server, port = await start_server(service, settings.grpc.host, settings.grpc.port, tls)
    admin, admin_port = await _start_admin(settings, service)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ssd = ", no SSD tier"
    if store.ssd is not None:
        ssd = f", SSD {settings.ssd_dir} ({len(store.ssd)} blocks)"
    log.info("serving on %s:%d: RAM %d bytes%s", settings.grpc.host, port, settings.ram_bytes, ssd)
    announce_ready(ready_file, f"serving on port {port}", ports={"grpc": port, "admin": admin_port})
    try:
        await stop.wait()
    finally:
        announce_stopping()
        service.events.close()
        await server.stop(GRACE_S)
        await admin.cleanup()
        if tracer is not None:
            await asyncio.to_thread(tracer.close)  # what is queued goes out, bounded
        if ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(ready_file.unlink)


async def _start_admin(
    settings: KvcachedSettings, service: KvCacheService
) -> tuple[web.AppRunner, int]:
    """/metrics (Prometheus) and /healthz, open to probes and scrapers; /v1/kv/events (what
    each tier holds, for routers) to bearers of `events_token` when one is set."""
    store = service.store
    registry = registry_for(store)
    if service.tracer is not None:
        registry.register(SpanCounts(service.tracer, "cgn_kvcached"))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "ssd_degraded": store.ssd_degraded})

    middlewares = [error_middleware(1 << 20)]
    if settings.events_token:
        middlewares.append(bearer_middleware(settings.events_token, OPEN_ADMIN_PATHS))
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/kv/events", lambda r: serve_sse(service.events, r))
    sock = bind_tcp(settings.admin.host, settings.admin.port)
    runner = Runner(app, idle_timeout_s=settings.admin.idle_timeout_s, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, int(sock.getsockname()[1])


def run(settings: KvcachedSettings, ready_file: Path | None) -> None:
    asyncio.run(serve(settings, ready_file))
