"""cgn-agent command line (typer; see cgn_core.cli for the shared parts)."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cgn_agent.settings import AgentSettings
from cgn_core.cli import fail, flag, load_service_settings, make_app, parse_overrides, run
from cgn_core.logs import setup_logging

app = make_app(
    "agent",
    "Per-node agent: hardware inventory, engine supervision, registration in etcd.",
    AgentSettings,
)

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML settings file.", envvar="CGN_AGENT_CONFIG"),
]
SetOpt = Annotated[list[str] | None, flag("--set", "Override a setting: --set lease_ttl_s=5.")]


@app.command("run")
def run_agent(
    etcd: Annotated[
        str | None, flag("--etcd", "etcd endpoints, comma-separated (default 127.0.0.1:2379).")
    ] = None,
    node_id: Annotated[
        str | None, flag("--node-id", "This node's id (default: derived once from the host name).")
    ] = None,
    state_dir: Annotated[
        Path | None,
        flag("--state-dir", "Node id, replica records and engine logs (/var/lib/cognitora/agent)."),
    ] = None,
    admin_port: Annotated[
        int | None, flag("--admin-port", "Admin port: /metrics, /healthz, /replicas (9093).")
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    ready_file: Annotated[
        Path | None, flag("--ready-file", "Write {pid, ports, node} here once serving.")
    ] = None,
) -> None:
    """Run the engines that etcd places on this node, supervise them and publish them.

    Watches /cognitora/placements/<node>/, starts each replica with its engine's
    driver, publishes /cognitora/replicas/<node>/<replica> and, once Ready,
    /cognitora/endpoints/<node>/<model>/<replica>; see docs/cgn-agent.md.
    """
    flags = parse_overrides(set_)
    for key, value in {
        "etcd.endpoints": etcd,
        "node_id": node_id,
        "state_dir": state_dir,
        "admin.port": admin_port,
    }.items():
        if value is not None:
            flags[key] = str(value)
    settings = load_service_settings(AgentSettings, "agent", config, flags)
    setup_logging("agent", settings.log)
    from cgn_agent.daemon import run as run_daemon

    try:
        settings.state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"state_dir {settings.state_dir}: {exc.strerror} (set --state-dir)", 2)
    run_daemon(settings, ready_file)


@app.command()
def inventory(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Print this node's hardware inventory as the scheduler will see it.

    CPU, RAM, NVIDIA GPUs (nvidia-smi; NVML topology where nvidia-ml-py imports),
    Apple silicon, RDMA links, accelerator classes, health flags and the engines
    installed here. Reads only; starts nothing.
    """
    from cgn_agent.drivers import SystemToolbox, installed_engines
    from cgn_agent.inventory.collect import collect
    from cgn_agent.power import rapl_zones
    from cgn_core.nodeid import derive_node_id

    settings = load_service_settings(AgentSettings, "agent", config, parse_overrides(set_))
    node = settings.node_id or _peek_node_id(settings.state_dir) or derive_node_id()
    engines = installed_engines(SystemToolbox(), settings.engines.offer)
    inv = collect(node, engines=engines, labels=settings.labels)
    zones, notes = rapl_zones()
    power = "rapl" if zones else "unknown"
    if any(a.kind == "nvidia" and a.power_w is not None for a in inv.accelerators):
        power = "nvidia" if power == "unknown" else f"{power}+nvidia"
    doc = inv.to_json() | {"power_source": power, "notes": [*inv.notes, *notes]}
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    _render(doc)


def _peek_node_id(state_dir: Path) -> str:
    try:
        return (state_dir / "node_id").read_text().strip()
    except OSError:
        return ""


def _render(doc: dict[str, object]) -> None:
    console = Console()
    cpu = doc["cpu"]
    assert isinstance(cpu, dict)
    console.print(
        f"[bold]{doc['node']}[/bold] ({doc['hostname']}): class [bold]{doc['node_class']}[/bold], "
        f"{cpu['model']}, {cpu['cores']} cores, {cpu['ram_mib'] / 1024:.1f} GiB RAM, "
        f"power: {doc['power_source']}"
    )
    accs = doc["accelerators"]
    assert isinstance(accs, list)
    if accs:
        t = Table("#", "device", "class", "memory", "used", "power", "health")
        for a in accs:
            power = "-" if a["power_w"] is None else f"{a['power_w']:.0f} W"
            t.add_row(
                str(a["index"]),
                a["name"],
                a["accel_class"],
                f"{a['memory_mib']} MiB",
                f"{a['memory_used_mib']} MiB",
                power,
                "; ".join(a["health"]) or "ok",
            )
        console.print(t)
    else:
        console.print("no accelerators")
    links = doc["network"]
    assert isinstance(links, list)
    for link in links:
        console.print(
            f"rdma {link['device']}/{link['port']}: {link['state']}, "
            f"{link['rate_gbps']} Gb/s, {link['link_layer']}"
        )
    console.print(f"engines installed: {', '.join(doc['engines']) or 'none'}")  # type: ignore[arg-type]
    notes = doc["notes"]
    assert isinstance(notes, list)
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")


main = run(app)
