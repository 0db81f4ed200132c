"""cgn-router command line (typer; see cgn_core.cli for the shared parts)."""

from pathlib import Path
from typing import Annotated

import typer

from cgn_core.cli import flag, load_service_settings, make_app, parse_overrides, run
from cgn_core.logs import setup_logging
from cgn_router.settings import RouterSettings

app = make_app(
    "router",
    "The OpenAI-compatible gateway: KV-aware routing, admission, streaming proxy.",
    RouterSettings,
)


@app.command()
def serve(
    host: Annotated[
        str | None, flag("--host", "OpenAI API listen address (default 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None, flag("--port", "OpenAI API port (0: any free port) (default 8080).")
    ] = None,
    admin_port: Annotated[
        int | None, flag("--admin-port", "Admin port: /metrics, /healthz, /readyz (default 9091).")
    ] = None,
    etcd: Annotated[
        str | None, flag("--etcd", "etcd endpoints, comma-separated (default 127.0.0.1:2379).")
    ] = None,
    static: Annotated[
        bool,
        typer.Option("--static", help="No etcd: route to the endpoints in the config file only."),
    ] = False,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="YAML settings file.", envvar="CGN_ROUTER_CONFIG"),
    ] = None,
    set_: Annotated[
        list[str] | None, flag("--set", "Override a setting: --set routing.prefix=2.0.")
    ] = None,
    ready_file: Annotated[
        Path | None, flag("--ready-file", "Write {pid, ports} here once serving.")
    ] = None,
    epp: Annotated[
        bool,
        typer.Option(
            "--epp",
            help="Also serve as a Kubernetes gateway's endpoint picker (Envoy ext_proc, "
            "Gateway API Inference Extension) on epp.port (9002), health on "
            "epp.health_port (9003); one process (--workers 1). See docs/gateway.md.",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        flag(
            "--workers",
            "Router processes sharing the port, each on a core (default: one per core; "
            "1: a single process). SIGHUP restarts them one by one, re-reading --config.",
        ),
    ] = None,
) -> None:
    """Serve the OpenAI API and route each request to the engine best placed for it.

    Endpoints come from etcd (/cognitora/endpoints/, written by cgn-agent) and from
    the `endpoints:` map of the config file; see docs/cgn-router.md.
    """
    flags = parse_overrides(set_)
    for key, value in {
        "http.host": host,
        "http.port": port,
        "admin.port": admin_port,
        "etcd.endpoints": etcd,
        "discovery": "static" if static else None,
        "workers": 1 if epp and workers is None else workers,
        "epp.enabled": "true" if epp else None,
    }.items():
        if value is not None:
            flags[key] = str(value)
    settings = load_service_settings(RouterSettings, "router", config, flags)
    setup_logging("router", settings.log)
    from cgn_router.daemon import run as run_daemon

    run_daemon(settings, ready_file, source=(config, flags))


@app.command(hidden=True)
def worker() -> None:
    """A worker process of `serve --workers N`, started by its supervisor (workers/supervisor.py):
    the settings the supervisor was given, read again (a reload sees a changed config file),
    on the held ports."""
    import json
    import os

    from cgn_router.daemon import run as run_daemon
    from cgn_router.workers.supervisor import FLAGS_ENV, WorkerRole, stop_with_parent

    role = WorkerRole.from_env()
    stop_with_parent(role.supervisor)
    flags = json.loads(os.environ[FLAGS_ENV])
    config = flags.pop("config") or None
    flags.update({"http.port": str(role.http_port), "workers": "1"})
    if role.primary:
        flags["admin.port"] = str(role.admin_port)
    else:  # NOTE: one reconciler per router host; the others need no vote
        flags.update({"admin.host": "127.0.0.1", "admin.port": "0", "reconciler.enabled": "false"})
    path = Path(config) if config else None
    settings = load_service_settings(RouterSettings, "router", path, flags)
    setup_logging("router", settings.log)
    run_daemon(settings, role.ready_file(), worker=role)


main = run(app)

if __name__ == "__main__":  # a worker: python -m cgn_router.cli worker
    main()
