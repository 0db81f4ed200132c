"""cgn-metrics command line (typer; see cgn_core.cli for the shared parts)."""

from pathlib import Path
from typing import Annotated

from cgn_core.cli import flag, load_service_settings, make_app, parse_overrides, run
from cgn_core.logs import setup_logging
from cgn_metrics.settings import MetricsSettings

app = make_app(
    "metrics", "Fleet metrics, energy per token, and the live dashboard.", MetricsSettings
)


@app.command()
def serve(
    host: Annotated[str | None, flag("--host", "Listen address (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, flag("--port", "HTTP port (0: any free port) (default 9092).")
    ] = None,
    target: Annotated[
        list[str] | None,
        flag("--target", "Also scrape KIND=URL (router, agent, engine, kvcached) or URL; repeat."),
    ] = None,
    static: Annotated[
        bool, flag("--static", "Scrape only --target/targets; do not read etcd.")
    ] = False,
    file_sd: Annotated[
        Path | None, flag("--file-sd", "Write a Prometheus file_sd target list here.")
    ] = None,
    config: Annotated[
        Path | None, flag("--config", "YAML settings file.", "CGN_METRICS_CONFIG")
    ] = None,
    set_: Annotated[
        list[str] | None, flag("--set", "Override a setting: --set scrape_interval_s=10.")
    ] = None,
    ready_file: Annotated[
        Path | None, flag("--ready-file", "Write {pid, ports} here once serving.")
    ] = None,
) -> None:
    """Scrape the fleet's /metrics and serve the dashboard at http://HOST:PORT/.

    Targets come from etcd (agents, engines, kvcached daemons; nodes' states) and from
    --target / `targets` (routers register nowhere: list them). Serves the live dashboard
    at /, its JSON at /api/v1/fleet and /api/v1/history, fleet-level series at /metrics,
    every target's samples at /federate, and /health. Energy per token is shown only
    where an agent measures power (RAPL, NVML, powermetrics); elsewhere it says
    "unavailable"."""
    flags = parse_overrides(set_)
    for key, value in {"http.host": host, "http.port": port, "file_sd": file_sd}.items():
        if value is not None:
            flags[key] = str(value)
    if static:
        flags["discovery"] = "static"
    if target:
        flags["targets"] = ",".join(target)
    settings = load_service_settings(MetricsSettings, "metrics", config, flags)
    setup_logging("metrics", settings.log)
    from cgn_metrics.daemon import run as run_daemon

    run_daemon(settings, ready_file)


main = run(app)
