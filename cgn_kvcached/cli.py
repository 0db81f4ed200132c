"""cgn-kvcached command line (typer; see cgn_core.cli for the shared parts)."""

from pathlib import Path
from typing import Annotated

from cgn_core.cli import flag, load_service_settings, make_app, parse_overrides, run
from cgn_core.logs import setup_logging
from cgn_kvcached.settings import KvcachedSettings

app = make_app(
    "kvcached", "Per-node tiered KV block store (RAM, then SSD) over gRPC.", KvcachedSettings
)


@app.command()
def serve(
    host: Annotated[str | None, flag("--host", "gRPC listen address (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, flag("--port", "gRPC port (0: any free port) (default 7071).")
    ] = None,
    admin_port: Annotated[
        int | None, flag("--admin-port", "Admin port: /metrics, /healthz (default 9094).")
    ] = None,
    ram_bytes: Annotated[
        int | None, flag("--ram-bytes", "The RAM tier's budget in bytes (default 4 GiB).")
    ] = None,
    ssd_dir: Annotated[
        Path | None, flag("--ssd-dir", "The SSD tier's directory (default: none, RAM only).")
    ] = None,
    ssd_bytes: Annotated[int | None, flag("--ssd-bytes", "The SSD tier's budget in bytes.")] = None,
    config: Annotated[
        Path | None, flag("--config", "YAML settings file.", "CGN_KVCACHED_CONFIG")
    ] = None,
    set_: Annotated[
        list[str] | None, flag("--set", "Override a setting: --set write_through=true.")
    ] = None,
    ready_file: Annotated[
        Path | None, flag("--ready-file", "Write {pid, ports} here once serving.")
    ] = None,
) -> None:
    """Serve the node's KV block store (Put, Get, Lookup, Stats, Evict, Clear) over gRPC.

    cgn-infer engines on this node use it with `--kvcached 127.0.0.1:PORT` (blocks move
    through shared memory in shm_dir); routers follow what each tier holds at
    http://ADMIN_HOST:ADMIN_PORT/v1/kv/events (set admin.host and events_token for routers
    on other machines). Under cgn-agent, `kvcached.mode=run` starts it for you."""
    flags = parse_overrides(set_)
    for key, value in {
        "grpc.host": host,
        "grpc.port": port,
        "admin.port": admin_port,
        "ram_bytes": ram_bytes,
        "ssd_dir": ssd_dir,
        "ssd_bytes": ssd_bytes,
    }.items():
        if value is not None:
            flags[key] = str(value)
    settings = load_service_settings(KvcachedSettings, "kvcached", config, flags)
    setup_logging("kvcached", settings.log)
    from cgn_kvcached.daemon import run as run_daemon

    run_daemon(settings, ready_file)


main = run(app)
