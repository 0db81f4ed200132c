"""`cgn-infer serve`: bind, load the model in the background, serve, shut down cleanly.

The HTTP listener comes up first, so /health answers 503 while the weights
load; the `--ready-file` is written once the model is loaded and serving.
SIGTERM/SIGINT only set an event; shutdown then stops accepting, gives the
answers still streaming STREAMS_GRACE_S to end (aiohttp may take as long again
to close a cancelled one), closes the rest (a router
continues them on another replica: request migration), lets the engine finish
its current step and exits. The agent sends SIGTERM only after a replica's
requests have finished or its drain timeout has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import ssl
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cgn_core import bundled_models
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.http import Runner
from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.kv.client import KvCacheClient
from cgn_core.kv.events import KvEventHub
from cgn_core.kv.layout import Layout
from cgn_core.readiness import announce_ready, announce_stopping, bind_tcp
from cgn_core.tls import server_ssl_context, warn_if_plaintext
from cgn_core.tracing import SpanCounts, Tracer
from cgn_infer.adapters import Adapters
from cgn_infer.backends.base import Backend
from cgn_infer.engine import Engine, EngineConfig
from cgn_infer.kv_tiering import RestoreCost
from cgn_infer.loader import LoadedModel, load_model, make_adapters
from cgn_infer.metrics import EngineMetrics
from cgn_infer.models import args_from_gguf
from cgn_infer.server import InferenceService, Serving, build_app
from cgn_infer.settings import InferSettings
from cgn_infer.transfer import TransferSink, TransferSource

# Bumped whenever the serialized block format (Backend.read_blocks) changes: blocks written
# under another format are then never read back.
KV_FORMAT = "kv1"

log = logging.getLogger(__name__)
STREAMS_GRACE_S = 2.0


def model_name(settings: InferSettings) -> str:
    """The name clients ask for: `model_name`, a bundled model's own name, or the file's
    stem (a bundled name's stem would cut "qwen2.5-coder-0.5b" at its first dot)."""
    if settings.model_name:
        return settings.model_name
    if settings.model is None:
        return "model"
    return str(settings.model) if bundled_models.is_bundled(settings.model) else settings.model.stem


@dataclass(slots=True)
class _Listener:
    """One engine's HTTP side: its service (metrics, KV event hub) on its own port."""

    svc: InferenceService
    runner: Runner
    port: int


async def serve(settings: InferSettings, ready_file: Path | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    name = model_name(settings)
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
    listeners: list[_Listener] = []
    tracer = Tracer(settings.tracing, "cgn-infer", name) if settings.tracing.enabled else None
    try:
        for port in engine_ports(settings):
            listeners.append(await _listen(settings, name, port, ssl_ctx, tracer))
        scheme = "https" if ssl_ctx else "http"
        log.info(
            "listening on %s://%s:%s (model %s loading)",
            scheme,
            settings.http.host,
            _port_list(listeners),
            name,
        )
        await _serve_loaded(settings, name, listeners, ready_file, stop)
    finally:
        # what _serve_loaded did not close already (it failed before serving, or binding did)
        for listener in listeners:
            if listener.runner.server is not None:
                await listener.runner.cleanup()
        if tracer is not None:
            await asyncio.to_thread(tracer.close)  # what is queued goes out, bounded


def _port_list(listeners: list[_Listener]) -> str:
    ports = [str(x.port) for x in listeners]
    return (
        ports[0] if len(ports) == 1 else f"{ports[0]} and {len(ports) - 1} more (virtual engines)"
    )


def engine_ports(settings: InferSettings) -> list[int]:
    """The port of each engine this process hosts: `http.port` and the ones after it, or all
    0 (any free port) when `http.port` is 0. More than one only for the sim's `sim.engines`."""
    base, n = settings.http.port, settings.sim.engines
    return [base + i if base else 0 for i in range(n)]


async def _listen(
    settings: InferSettings,
    name: str,
    port: int,
    ssl_ctx: ssl.SSLContext | None,
    tracer: Tracer | None = None,
) -> _Listener:
    svc = InferenceService(
        name,
        EngineMetrics(name),
        KvEventHub(name),
        body_timeout_s=settings.http.body_timeout_s,
        tracer=tracer,
    )
    if tracer is not None:
        svc.metrics.registry.register(SpanCounts(tracer, "cgn_infer"))
    sock = bind_tcp(settings.http.host, port)
    runner = Runner(
        build_app(svc, settings.api_token, client_certs=ssl_ctx is not None),
        idle_timeout_s=settings.http.idle_timeout_s,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=STREAMS_GRACE_S,
    )
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=ssl_ctx).start()
    return _Listener(svc, runner, sock.getsockname()[1])


async def _serve_loaded(
    settings: InferSettings,
    name: str,
    listeners: list[_Listener],
    ready_file: Path | None,
    stop: asyncio.Event,
) -> None:
    """Load the model once, give every listener its own engine (scheduler, pool, worker
    thread), announce ready, and run until `stop`."""
    started = time.monotonic()
    # One thread does all torch work: loading, allocating the KV pool, then every step.
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="cgn-infer-engine")
    try:
        loaded = await _load(settings, torch_thread)
    except ConfigError:
        torch_thread.shutdown(wait=False)
        raise
    engines: list[Engine] = []
    sources: list[TransferSource] = []
    try:
        engines += await _build_engines(settings, loaded, listeners, torch_thread)
        for i, (listener, engine) in enumerate(zip(listeners, engines, strict=True)):
            # NOTE: after every engine is built: the first one's worker takes torch_thread
            listener.svc.metrics.load_seconds.set(time.monotonic() - started)
            engine.start()
            source, sink = await _transfers(settings, listener, engine, i)
            sources += [source] if source is not None else []
            listener.svc.serve(_serving(settings, loaded, listener, engine, source, sink))
        _announce(settings, name, loaded, listeners, engines, sources, started, ready_file)
        # the grammar vocabulary (up to a second) is built after ready, off the request path
        warm = asyncio.get_running_loop().run_in_executor(None, _warm_grammars, loaded)
        await stop.wait()
        await warm
    finally:
        await _shut_down(listeners, engines, sources, torch_thread, ready_file)


async def _load(settings: InferSettings, torch_thread: ThreadPoolExecutor) -> LoadedModel:
    """The model, loaded on the torch thread with a progress bar, and its KV pool checked
    against the host's memory; a bad file or a pool that cannot fit is a ConfigError."""
    loop = asyncio.get_running_loop()
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
            raise ConfigError(exc.message) from None
    check_pool_fits(settings, loaded.backend, available_memory())
    return loaded


async def _build_engines(
    settings: InferSettings,
    loaded: LoadedModel,
    listeners: list[_Listener],
    torch_thread: ThreadPoolExecutor,
) -> list[Engine]:
    """One engine per listener over the loaded model, each with its own scheduler and pool
    (allocated on the torch thread); a pipeline head's stage metrics on the first."""
    loop = asyncio.get_running_loop()
    config = EngineConfig(
        ctx=settings.ctx,
        kv_pool_tokens=settings.kv_pool_tokens,
        max_batch=settings.max_batch,
        prefill_chunk=settings.prefill_chunk,
        aging_steps=settings.aging_steps,
    )
    engines = []
    for i, listener in enumerate(listeners):
        # The first engine steps on the thread that loaded the model; a virtual sim
        # engine gets its own (it only sleeps there).
        executor = torch_thread if i == 0 else None
        build = functools.partial(_engine, settings, loaded, listener.svc, config, loop, executor)
        engines.append(await loop.run_in_executor(torch_thread, build))
    if (collector := loaded.backend.collector) is not None:  # a pipeline head's stages
        listeners[0].svc.metrics.registry.register(collector)
    return engines


def _serving(
    settings: InferSettings,
    loaded: LoadedModel,
    listener: _Listener,
    engine: Engine,
    source: TransferSource | None,
    sink: TransferSink | None,
) -> Serving:
    return Serving(
        engine,
        loaded.codec,
        loaded.grammars,
        engine.ctx,
        engine.capacity_tokens,
        role=settings.role,
        engine_id=f"{listener.svc.model_name}@{settings.http.host}:{listener.port}",
        transfer_source=source,
        transfer_sink=sink,
        adapters=loaded.adapters or _sim_adapters(settings, loaded),
        lora_dirs=settings.lora_dirs,
    )


def _sim_adapters(settings: InferSettings, loaded: LoadedModel) -> Adapters | None:
    """A sim engine's own adapter slots (each virtual engine holds its own set)."""
    if settings.backend != "sim" or not (settings.lora or settings.lora_dirs):
        return None
    return make_adapters(settings, loaded.gguf, args_from_gguf(loaded.gguf))


def _announce(
    settings: InferSettings,
    name: str,
    loaded: LoadedModel,
    listeners: list[_Listener],
    engines: list[Engine],
    sources: list[TransferSource],
    started: float,
    ready_file: Path | None,
) -> None:
    """Say what serves where: the log lines, then the ready file and systemd's READY=1."""
    first, per_token = engines[0], loaded.backend.kv_bytes_per_token()
    log.info(
        "KV pool: %d tokens in %d-token blocks, %.1f MiB (%d bytes per token)%s",
        first.capacity_tokens,
        BLOCK_SIZE,
        first.capacity_tokens * per_token / 2**20,
        per_token,
        f", in each of {len(engines)} virtual engines" if len(engines) > 1 else "",
    )
    if sources:
        log.info(
            "role %s: transfer blocks served on %s:%d",
            settings.role,
            settings.transfer.host,
            sources[0].port,
        )
    log.info(
        "model %s loaded in %.1fs; serving on port %s",
        name,
        time.monotonic() - started,
        _port_list(listeners),
    )
    ports = [x.port for x in listeners]
    announce_ready(
        ready_file,
        f"serving {name} on port {ports[0]}",
        ports={"http": ports[0], **({"kv_transfer": sources[0].port} if sources else {})},
        model=name,
        engines=ports,
        transfer_ports=[x.port for x in sources],
        role=settings.role,
    )


async def _shut_down(
    listeners: list[_Listener],
    engines: list[Engine],
    sources: list[TransferSource],
    torch_thread: ThreadPoolExecutor,
    ready_file: Path | None,
) -> None:
    """Stop accepting, close the streams and transfers, let each engine finish its step."""
    log.info("shutting down")
    announce_stopping()
    for listener in listeners:
        listener.svc.kv_events.close()
    for listener in listeners:
        await listener.runner.cleanup()
    for source in sources:
        await source.stop()
    for listener in listeners:
        if listener.svc.serving is not None and listener.svc.serving.transfer_sink:
            listener.svc.serving.transfer_sink.close()
    for engine in engines:
        await asyncio.to_thread(engine.stop)
    if not engines:
        torch_thread.shutdown(wait=False)
    if ready_file is not None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(ready_file.unlink)


def _warm_grammars(loaded: LoadedModel) -> None:
    try:
        loaded.grammars.warm()
    except Exception:  # NOTE: the first constrained request builds it again, and says why
        log.exception("could not build the grammar vocabulary")


def _engine(
    settings: InferSettings,
    loaded: LoadedModel,
    svc: InferenceService,
    config: EngineConfig,
    loop: asyncio.AbstractEventLoop,
    executor: ThreadPoolExecutor | None,
) -> Engine:
    """One engine over the loaded model, publishing its KV events on `svc`'s hub."""
    kvcache, restore_cost = kvcache_client(settings, loaded.backend)
    hub = svc.kv_events
    return Engine(
        loaded.backend,
        loaded.codec.tokenizer,
        svc.metrics,
        config,
        namespace=svc.model_name,
        on_kv_events=lambda events: loop.call_soon_threadsafe(hub.publish, events),
        on_stats=lambda stats: loop.call_soon_threadsafe(svc.metrics.observe, stats),
        executor=executor,
        kvcache=kvcache,
        restore_cost=restore_cost,
        grammars=loaded.grammars,
    )


def engine_layout(backend: Backend) -> Layout:
    """What this engine's serialized blocks are: the same for the node's store and for
    transfers to a decode engine (blocks of another layout are never exchanged)."""
    dtype, layers, kv_heads, head_dim = backend.kv_layout()
    # the C backend's pool is the torch backend's on CPU, block for block: one format
    family = "torch" if backend.name == "c" else backend.name
    return Layout(dtype, layers, kv_heads, head_dim, BLOCK_SIZE, f"cgn-infer {family} {KV_FORMAT}")


async def _transfers(
    settings: InferSettings, listener: _Listener, engine: Engine, index: int
) -> tuple[TransferSource | None, TransferSink | None]:
    """What an engine's role needs: a source for prefill legs (started; to be stopped) and
    a sink for decode legs. A simulated backend's transfers are charged its modelled time."""
    backend, t = engine.backend, settings.transfer
    layout, modelled = engine_layout(backend), backend.modelled
    sink = source = None
    if settings.role != "prefill":
        block_bytes = backend.kv_bytes_per_token() * BLOCK_SIZE
        sink = TransferSink(
            layout,
            engine.pool,
            listener.svc.metrics,
            t,
            settings.tls,
            modelled_block_bytes=block_bytes if modelled else None,
            speed=modelled.speed if modelled else 1.0,
        )
    if settings.role != "decode":
        port = t.port + index if t.port else 0  # virtual sim engines: the next ports
        source = TransferSource(layout, dataclasses.replace(t, port=port), settings.tls)
        listener.svc.metrics.kv_transfer_holding.set_function(lambda: source.holding)
        await source.start()
    return source, sink


def kvcache_client(
    settings: InferSettings, backend: Backend
) -> tuple[KvCacheClient | None, RestoreCost | None]:
    """The client of the node's KV store, under this engine's block layout; (None, None)
    when no address is set. Connecting is lazy: a kvcached that is down means recompute."""
    s = settings.kvcached
    if not s.address:
        return None, None
    layout = engine_layout(backend)
    tls = settings.tls if settings.tls.enabled else None
    client = KvCacheClient(
        s.address,
        layout,
        tls=tls,
        token=s.token,
        timeout_s=s.timeout_s,
        shared_memory=s.shared_memory,
    )
    # A simulated backend starts from what it charges: its modelled costs, `speed` x faster.
    modelled = backend.modelled
    speed = modelled.speed if modelled else 1.0
    prefill = modelled.prefill_s_per_token if modelled else 1 / s.prefill_tokens_per_s
    cost = RestoreCost(
        fixed_s=s.fixed_ms / 1e3 / speed,
        s_per_byte={
            "ram": 1 / (s.ram_mb_per_s * 1e6 * speed),
            "ssd": 1 / (s.ssd_mb_per_s * 1e6 * speed),
        },
        prefill_s_per_token=prefill / speed,
    )
    log.info(
        "KV store: cgn-kvcached at %s (layout %s, %d bytes per block)",
        s.address,
        layout.digest.hex(),
        layout.block_bytes,
    )
    return client, cost


POOL_MEMORY_SHARE = 0.8  # of the memory available at start, at most, for the KV pool


BLOCK_BOOKKEEPING_BYTES = 256  # host memory per pool block, whatever holds its KV (~236)


def check_pool_fits(settings: InferSettings, backend: Backend, available: int | None) -> None:
    """Refuse a KV pool the host cannot hold: allocating it would end in the OOM killer.

    A pool in host memory needs its KV bytes; every pool (a GPU's, a simulated one) needs
    its blocks' bookkeeping in host memory. `available` is MemAvailable, None where it
    cannot be read (then nothing is checked)."""
    if available is None:
        return
    in_host = backend.modelled is None and settings.device.startswith("cpu")
    bytes_per_token = backend.kv_bytes_per_token() if in_host else 0
    blocks = settings.kv_pool_tokens // BLOCK_SIZE
    need = settings.kv_pool_tokens * bytes_per_token + blocks * BLOCK_BOOKKEEPING_BYTES
    if need > POOL_MEMORY_SHARE * available:
        what = f"{bytes_per_token} bytes per token" if in_host else "its blocks' bookkeeping"
        raise ConfigError(
            f"kv_pool_tokens={settings.kv_pool_tokens} needs {need / 2**30:.1f} GiB of host "
            f"memory ({what}); this host has {available / 2**30:.1f} GiB available and the "
            f"pool may take {POOL_MEMORY_SHARE:.0%} of it: lower --kv-pool-tokens"
            + (" (or a 16-bit --kv-dtype)" if in_host and settings.kv_dtype == "float32" else "")
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
