"""`cgn-infer serve`: bind, load the model in the background, serve, shut down cleanly.

The HTTP listener comes up first, so /health answers 503 while the weights
load; the `--ready-file` is written once the model is loaded and serving.
SIGTERM/SIGINT only set an event; shutdown then stops accepting, lets the
engine finish its current step and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cgn_core.blockhash import BLOCK_SIZE
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.http import Runner
from cgn_core.kv_events import KvEventHub
from cgn_core.kv_layout import Layout
from cgn_core.kvcache_client import KvCacheClient
from cgn_core.readiness import announce_ready, announce_stopping, bind_tcp
from cgn_core.tls import server_ssl_context, warn_if_plaintext
from cgn_infer.backends.base import Backend
from cgn_infer.engine import Engine, EngineConfig
from cgn_infer.kv_tiering import RestoreCost
from cgn_infer.loader import load_model
from cgn_infer.metrics import EngineMetrics
from cgn_infer.server import InferenceService, Loaded, build_app
from cgn_infer.settings import InferSettings

# Bumped whenever the serialized block format (Backend.read_blocks) changes: blocks written
# under another format are then never read back.
KV_FORMAT = "kv1"

log = logging.getLogger(__name__)


def model_name(settings: InferSettings) -> str:
    if settings.model_name:
        return settings.model_name
    return settings.model.stem if settings.model else "model"


async def serve(settings: InferSettings, ready_file: Path | None) -> None:
    check_settings(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    name = model_name(settings)
    svc = InferenceService(name, EngineMetrics(name), settings.ctx, KvEventHub(name),
                           body_timeout_s=settings.http.body_timeout_s)  # fmt: skip
    sock = bind_tcp(settings.http.host, settings.http.port)
    port = sock.getsockname()[1]
    if not settings.api_token:
        log.warning(
            "engine API authentication is OFF (no api_token): anyone who reaches its port "
            "can use it; fine for development only"
        )
    ssl_ctx = (
        server_ssl_context(settings.tls, client_cert="optional") if settings.tls.enabled else None
    )
    if ssl_ctx is None:
        warn_if_plaintext(log, "engine API", settings.tls)
    runner = Runner(
        build_app(svc, settings.api_token, client_certs=ssl_ctx is not None),
        idle_timeout_s=settings.http.idle_timeout_s,
        handler_cancellation=True,
        access_log=None,
    )
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=ssl_ctx).start()
    scheme = "https" if ssl_ctx else "http"
    log.info("listening on %s://%s:%d (model %s loading)", scheme, settings.http.host, port, name)

    started = time.monotonic()
    # One thread does all torch work: loading, allocating the KV pool, then every step.
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="cgn-infer-engine")
    with _progress() as progress:
        task = progress.add_task(f"loading {settings.model}", total=None)
        try:
            loaded = await loop.run_in_executor(
                torch_thread,
                load_model,
                settings,
                lambda done, total: progress.update(task, completed=done, total=total),
            )
        except CognitoraError as exc:  # a bad model file is the operator's configuration
            torch_thread.shutdown(wait=False)
            await runner.cleanup()
            raise ConfigError(exc.message) from None
    try:
        check_pool_fits(settings, loaded.backend.kv_bytes_per_token(), available_memory())
    except ConfigError:
        torch_thread.shutdown(wait=False)
        await runner.cleanup()
        raise
    config = EngineConfig(
        ctx=settings.ctx,
        kv_pool_tokens=settings.kv_pool_tokens,
        max_batch=settings.max_batch,
        prefill_chunk=settings.prefill_chunk,
        aging_steps=settings.aging_steps,
    )
    kvcache, restore_cost = kvcache_client(settings, loaded.backend)
    engine = await loop.run_in_executor(  # the pool is allocated (and zeroed) there too
        torch_thread,
        lambda: Engine(
            loaded.backend, loaded.codec.tokenizer, svc.metrics, config, namespace=name,
            on_kv_events=lambda events: loop.call_soon_threadsafe(svc.kv_events.publish, events),
            executor=torch_thread, kvcache=kvcache, restore_cost=restore_cost,
        ),
    )  # fmt: skip
    svc.metrics.load_seconds.set(time.monotonic() - started)
    engine.start()
    svc.ctx, svc.kv_capacity = engine.ctx, engine.capacity_tokens
    log.info(
        "KV pool: %d tokens in %d-token blocks, %.1f MiB (%d bytes per token)",
        engine.capacity_tokens, BLOCK_SIZE,
        engine.capacity_tokens * loaded.backend.kv_bytes_per_token() / 2**20,
        loaded.backend.kv_bytes_per_token(),
    )  # fmt: skip
    svc.loaded = Loaded(engine, loaded.codec)
    log.info("model %s loaded in %.1fs; serving on port %d", name, time.monotonic() - started, port)
    announce_ready(ready_file, f"serving {name} on port {port}", ports={"http": port}, model=name)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        announce_stopping()
        svc.kv_events.close()
        await runner.cleanup()
        await asyncio.to_thread(engine.stop)
        if ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(ready_file.unlink)


def kvcache_client(
    settings: InferSettings, backend: Backend
) -> tuple[KvCacheClient | None, RestoreCost | None]:
    """The client of the node's KV store, under this engine's block layout; (None, None)
    when no address is set. Connecting is lazy: a kvcached that is down means recompute."""
    s = settings.kvcached
    if not s.address:
        return None, None
    dtype, layers, kv_heads, head_dim = backend.kv_layout()
    layout = Layout(dtype, layers, kv_heads, head_dim, BLOCK_SIZE,
                    f"cgn-infer {backend.name} {KV_FORMAT}")  # fmt: skip
    tls = settings.tls if settings.tls.enabled else None
    client = KvCacheClient(s.address, layout, tls=tls, timeout_s=s.timeout_s,
                           shared_memory=s.shared_memory)  # fmt: skip
    # The sim starts from what it charges: its modelled costs, all `speed` times faster.
    sim = settings.backend == "sim"
    speed = settings.sim.speed if sim else 1.0
    prefill = settings.sim.prefill_s_per_token if sim else 1 / s.prefill_tokens_per_s
    cost = RestoreCost(
        fixed_s=s.fixed_ms / 1e3 / speed,
        s_per_byte={
            "ram": 1 / (s.ram_mb_per_s * 1e6 * speed),
            "ssd": 1 / (s.ssd_mb_per_s * 1e6 * speed),
        },
        prefill_s_per_token=prefill / speed,
    )
    log.info("KV store: cgn-kvcached at %s (layout %s, %d bytes per block)", s.address,
             layout.digest.hex(), layout.block_bytes)  # fmt: skip
    return client, cost


POOL_MEMORY_SHARE = 0.8  # of the memory available at start, at most, for the KV pool


def check_pool_fits(settings: InferSettings, bytes_per_token: int, available: int | None) -> None:
    """Refuse a KV pool the host cannot hold: allocating it would end in the OOM killer.

    Only a pool in host memory is checked (the sim allocates none; a GPU's own allocator
    fails cleanly); `available` is MemAvailable, None where it cannot be read."""
    if settings.backend == "sim" or not settings.device.startswith("cpu") or available is None:
        return
    need = settings.kv_pool_tokens * bytes_per_token
    if need > POOL_MEMORY_SHARE * available:
        raise ConfigError(
            f"kv_pool_tokens={settings.kv_pool_tokens} needs {need / 2**30:.1f} GiB of KV cache "
            f"({bytes_per_token} bytes per token); this host has {available / 2**30:.1f} GiB "
            f"available and the pool may take {POOL_MEMORY_SHARE:.0%} of it: lower "
            f"--kv-pool-tokens (or use --kv-dtype bfloat16)"
        )


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is none (macOS)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_settings(settings: InferSettings) -> None:
    """Refuse values the engine cannot run with, naming the setting (before binding)."""
    least = {"max_batch": 1, "prefill_chunk": 1, "kv_pool_tokens": 16, "ctx": 2, "aging_steps": 0}
    for key, low in least.items():
        if getattr(settings, key) < low:
            raise ConfigError(f"{key} must be at least {low}, got {getattr(settings, key)}")
    if settings.sim.speed <= 0:
        raise ConfigError(f"sim.speed must be positive, got {settings.sim.speed}")
    kvc = settings.kvcached
    for key in ("timeout_s", "ram_mb_per_s", "ssd_mb_per_s", "prefill_tokens_per_s"):
        if getattr(kvc, key) <= 0:
            raise ConfigError(f"kvcached.{key} must be positive, got {getattr(kvc, key)}")
    if kvc.fixed_ms < 0:
        raise ConfigError(f"kvcached.fixed_ms must not be negative, got {kvc.fixed_ms}")
    if kvc.address and ":" not in kvc.address:
        raise ConfigError(f"kvcached.address must be host:port, got {kvc.address!r}")


def _progress() -> Progress:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
    )
    return Progress(*columns, TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty())


def run(settings: InferSettings, ready_file: Path | None) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # not on every platform
        pass
    asyncio.run(serve(settings, ready_file))
