"""cgn-ctl command line (typer; see cgn_core.cli for the shared parts).

Every command that reads the cluster takes --etcd (or CGN_CTL_ETCD__ENDPOINTS,
or etcd.endpoints in -c FILE) and prints a rich table, or JSON with --json.
Exit codes: 0 success; 1 a runtime failure (etcd unreachable, a model or node
not found, a drain that did not finish in time); 2 bad usage or a model file
the catalog refuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import yaml

from cgn_control import store
from cgn_core.cli import EXIT_USAGE, fail, flag, load_service_settings, make_app, run
from cgn_core.errors import CognitoraError
from cgn_core.etcd import EtcdClient
from cgn_core.files import read_regular
from cgn_core.terminal import for_terminal
from cgn_ctl import (
    cluster_ops,
    join_cmd,
    keys_cmd,
    pki_cmd,
    render,
    route_cmd,
    tenants_cmd,
    tokens_cmd,
)
from cgn_ctl.options import Config, Etcd, Json, StateDir, up_record, with_etcd
from cgn_ctl.settings import CtlSettings

T = TypeVar("T")
MAX_GRACE_S = 7 * 86400.0
MAX_CATALOG_FILE_BYTES = 16 << 20  # `models apply -f`: larger is not a catalog

app = make_app(
    "ctl",
    "Operate a Cognitora cluster: nodes, models, replicas, placement, PKI, keys, tenants.",
    CtlSettings,
)
models_app = typer.Typer(help="The model catalog: apply, list, get, delete.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(pki_cmd.app, name="pki")
app.add_typer(keys_cmd.app, name="keys")
app.add_typer(tenants_cmd.app, name="tenants")
app.add_typer(tokens_cmd.app, name="tokens")
app.command("join-service")(join_cmd.join_service)
app.command("join")(join_cmd.join_cmd)
app.command("explain-route")(route_cmd.explain_route)


def _emit(data: Any, as_json: bool, table: Callable[[Any], None]) -> None:
    """`data` as JSON, or through the `table` renderer with every string in it made safe for
    a terminal (records are strangers' text: cgn_core/terminal.py)."""
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
    else:
        table(for_terminal(data))


@app.command()
def nodes(etcd: Etcd = None, config: Config = None, as_json: Json = False) -> None:
    """Nodes: state (ready, unreachable, cordoned, draining), class, devices, what is unhealthy."""
    _emit(with_etcd(etcd, config, cluster_ops.nodes), as_json, render.nodes)


@app.command()
def replicas(
    model: Annotated[
        str | None, typer.Option("--model", help="Only this model's replicas.")
    ] = None,
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """Replicas: where each runs, its phase (from the agent) and the last failure reason."""
    _emit(
        with_etcd(etcd, config, lambda c: cluster_ops.replicas(c, model)), as_json, render.replicas
    )


@app.command("explain-placement")
def explain_placement(
    model: Annotated[str, typer.Argument(help="A model in the catalog.")],
    role: Annotated[
        str | None,
        typer.Option("--role", help="A disaggregated model's pool: prefill or decode."),
    ] = None,
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """Where one more replica of MODEL would go now: every candidate and what rejected it;
    for vLLM or SGLang across nodes, what each rank runs and its NCCL/Gloo environment."""
    d, ranks, adapters = with_etcd(etcd, config, lambda c: cluster_ops.explain(c, model, role))
    data = {
        "model": d.model,
        "role": role or "",
        "profile": d.profile,
        "nodes": [list(n) for n in d.nodes],
        "candidates": [
            {"node": c.node, "profile": c.profile, "ok": c.ok, "reason": c.reason}
            for c in d.candidates
        ],
        "ranks": ranks,
        "adapters": [dataclasses.asdict(a) for a in adapters],
    }
    _emit(data, as_json, render.explain)


@app.command("explain-scaling")
def explain_scaling(
    model: Annotated[str, typer.Argument(help="A model in the catalog.")],
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """The autoscaler's view of MODEL: each pool's target and current replicas, the rule that
    decided, the load it saw, and the last changes (written by the reconciler's leader)."""
    data = with_etcd(etcd, config, lambda c: cluster_ops.explain_scaling(c, model))
    _emit(data, as_json, render.explain_scaling)


@app.command()
def cordon(
    node: Annotated[str, typer.Argument(help="Node id.")],
    reason: Annotated[str, typer.Option("--reason", help="Recorded with the cordon.")] = "",
    pre: Annotated[
        bool, typer.Option("--pre", help="Cordon a node that has not joined (yet).")
    ] = False,
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Place nothing new on NODE (what runs there keeps running). Survives agent restarts."""

    async def work(c: EtcdClient) -> bool:
        known = await cluster_ops.node_exists(c, node)
        if known or pre:
            await cluster_ops.cordon(c, node, reason=reason)
        return known

    known = with_etcd(etcd, config, work)
    if not known and not pre:
        fail(
            f"no node {node!r} is registered (cgn-ctl nodes lists them); --pre cordons it "
            "before it joins",
            EXIT_USAGE,
        )
    typer.echo(f"{node} cordoned" if known else f"{node} pre-cordoned (it has not joined yet)")


@app.command()
def uncordon(
    node: Annotated[str, typer.Argument(help="Node id.")], etcd: Etcd = None, config: Config = None
) -> None:
    """Allow placements on NODE again (also ends a drain)."""
    removed = with_etcd(etcd, config, lambda c: cluster_ops.uncordon(c, node))
    typer.echo(f"{node} uncordoned" if removed else f"{node} was not cordoned")


@app.command()
def drain(
    node: Annotated[str, typer.Argument(help="Node id.")],
    grace: Annotated[
        float,
        typer.Option("--grace", help="Seconds before the remaining replicas are stopped anyway."),
    ] = 600.0,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait until the node runs nothing.")
    ] = True,
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Rolling drain: cordon NODE, start each replica elsewhere, stop the original once its
    replacement is Ready (or after --grace). Needs a running router (the reconciler)."""
    if not 0 < grace <= MAX_GRACE_S:  # NOTE: NaN fails this too
        fail(f"--grace must be a number of seconds from 0 to {MAX_GRACE_S:.0f}", EXIT_USAGE)

    async def work(c: EtcdClient) -> list[dict[str, Any]] | None:
        if not await cluster_ops.node_exists(c, node):
            return None
        await cluster_ops.cordon(c, node, drain=True, grace_s=grace)
        if not wait:
            return await cluster_ops.replicas_on(c, node)
        deadline = time.monotonic() + grace + 60
        shown = -1
        while True:
            left = await cluster_ops.replicas_on(c, node)
            if len(left) != shown:
                typer.echo(f"{node}: {len(left)} replica(s) left", err=True)
                shown = len(left)
            if not left:
                return left
            if time.monotonic() > deadline:
                names = ", ".join(r["replica"] for r in left)
                raise _DrainTimeout(f"{node} still runs {names} after {grace + 60:.0f}s")
            await asyncio.sleep(1.0)

    left = with_etcd(etcd, config, work)
    if left is None:
        fail(f"no node {node!r} is registered (cgn-ctl nodes lists them)", EXIT_USAGE)
    typer.echo(f"{node} drained" if not left else f"{node} draining ({len(left)} replica(s) left)")


class _DrainTimeout(CognitoraError):
    pass


@app.command()
def status(
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
    state_dir: StateDir = None,
) -> None:
    """The cluster at a glance: what `cgn-ctl up` started, the reconciler leader, nodes, models."""
    from cgn_ctl import upstate

    settings = load_service_settings(CtlSettings, "ctl", config, {})
    record = upstate.read_record(state_dir or settings.state_dir)
    local = upstate.running(record) if record else []
    # with no --etcd: the cluster `up` started, wherever its etcd listens, as its root
    data = with_etcd(etcd, config, cluster_ops.status, state_dir)
    data["local_processes"] = local
    _emit(data, as_json, render.status)


@app.command()
def top(
    metrics: Annotated[
        str | None,
        flag(
            "--metrics",
            "cgn-metrics' base URL (default: the one `cgn-ctl up` started, else "
            "http://127.0.0.1:9092).",
            "CGN_CTL_METRICS_URL",
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes.", min=0.2)
    ] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    as_json: Json = False,
    state_dir: StateDir = None,
    config: Config = None,
) -> None:
    """Live load per node and per model: replicas Ready, running and waiting requests, output
    tokens/s, KV use, watts and joules per token; per replica, the slowest first, the prefill
    and decode ms per token the routers learned; refreshed until Ctrl-C (from cgn-metrics).
    `--json` prints one frame as JSON; "—" is a figure no engine publishes."""
    from cgn_ctl import top as top_mod

    flags = {"metrics_url": metrics} if metrics else {}
    settings = load_service_settings(CtlSettings, "ctl", config, flags)
    url = settings.metrics_url
    if not url:
        record = up_record(state_dir, settings)
        dashboard = record.get("dashboard") if record else None
        url = dashboard if isinstance(dashboard, str) and dashboard else "http://127.0.0.1:9092"
    if as_json or once or not render.console.is_terminal:
        try:
            frame = top_mod.fetch(url)
        except CognitoraError as exc:
            fail(exc.message)
        _emit(frame.to_json(), as_json, lambda f: render.console.print(top_mod.render(frame)))
        return
    top_mod.live(url, interval, render.console)


@models_app.command("apply")
def models_apply(
    file: Annotated[
        Path, typer.Option("--file", "-f", help="YAML: one model, or several (--- or a list).")
    ],
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Validate and store models; refused as a whole, with the field path, if any is wrong."""
    try:
        text = read_regular(file, MAX_CATALOG_FILE_BYTES).decode("utf-8")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except OSError as exc:
        fail(f"{file}: {exc.strerror}", EXIT_USAGE)
    except UnicodeDecodeError:
        fail(f"{file}: not UTF-8 text", EXIT_USAGE)
    except RecursionError:
        fail(f"{file}: nested too deeply", EXIT_USAGE)
    except yaml.YAMLError as exc:
        fail(f"{file}: not YAML ({str(exc).splitlines()[0]})", EXIT_USAGE)
    if len(docs) == 1 and isinstance(docs[0], list):
        docs = docs[0]
    if not docs:
        fail(f"{file}: no model in the file", EXIT_USAGE)
    names = with_etcd(etcd, config, lambda c: store.apply_models(c, docs, str(file)))
    for name in names:
        typer.echo(f"model {name} applied")


@models_app.command("list")
def models_list(etcd: Etcd = None, config: Config = None, as_json: Json = False) -> None:
    """Every model: replicas placed and Ready against min–max, aliases, profiles."""
    _emit(with_etcd(etcd, config, cluster_ops.models), as_json, render.models)


@models_app.command("get")
def models_get(
    name: Annotated[str, typer.Argument(help="Model name.")],
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """One model's stored spec (YAML, or JSON with --json)."""
    doc = with_etcd(etcd, config, lambda c: cluster_ops.get_model(c, name))
    typer.echo(
        json.dumps(doc, indent=2) if as_json else yaml.safe_dump(doc, sort_keys=False).rstrip()
    )


@models_app.command("scale")
def models_scale(
    name: Annotated[str, typer.Argument(help="Model name.")],
    lo: Annotated[int | None, typer.Option("--min", help="Fewest replicas.")] = None,
    hi: Annotated[
        int | None, typer.Option("--max", help="Most replicas (the autoscaler's room).")
    ] = None,
    role: Annotated[
        str | None, typer.Option("--role", help="A disaggregated model's pool: prefill or decode.")
    ] = None,
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Change a model's replica bounds; with max above min, the autoscaler moves between them."""
    if lo is None and hi is None:
        fail("give --min, --max or both", EXIT_USAGE)
    spec = with_etcd(etcd, config, lambda c: store.scale_model(c, name, lo, hi, role))
    ((_, got_lo, got_hi),) = [w for w in spec.wants() if role is None or w[0] == role]
    typer.echo(f"model {name}{f' ({role})' if role else ''}: min {got_lo}, max {got_hi}")


@models_app.command("delete")
def models_delete(
    name: Annotated[str, typer.Argument(help="Model name.")],
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Remove a model from the catalog; the reconciler then stops its replicas."""
    with_etcd(etcd, config, lambda c: store.delete_model(c, name))
    typer.echo(f"model {name} deleted")


@app.command()
def up(
    model: Annotated[
        str, typer.Option("--model", help="A GGUF file, or a bundled model name.")
    ] = "smollm2",
    name: Annotated[str, typer.Option("--name", help="The model name clients use.")] = "",
    port: Annotated[int, typer.Option("--port", help="The router's OpenAI port.")] = 8080,
    admin_port: Annotated[
        int, typer.Option("--admin-port", help="The router's admin port.")
    ] = 9091,
    agent_port: Annotated[int, typer.Option("--agent-port", help="The agent's admin port.")] = 9093,
    etcd_port: Annotated[
        int, typer.Option("--etcd-port", help="Client port of the etcd it starts.")
    ] = 2379,
    etcd: Annotated[
        str | None, typer.Option("--etcd", help="Use this etcd instead of starting one.")
    ] = None,
    join: Annotated[
        str | None,
        typer.Option(
            "--join",
            help="Join another machine's cluster: its join service HOST:PORT, as `up --listen` "
            "printed it there (with --token and --ca-hash). Starts only this machine's agent. "
            "With --insecure: a plaintext cluster's etcd HOST:PORT.",
        ),
    ] = None,
    token: Annotated[
        str, typer.Option("--token", help="--join: the join token the first machine printed.")
    ] = "",
    ca_hash: Annotated[
        str,
        typer.Option(
            "--ca-hash", help="--join: the sha256:... of the cluster's CA, as printed there."
        ),
    ] = "",
    listen: Annotated[
        str,
        typer.Option(
            "--listen",
            help="An IP address of this machine: bind the cluster's ports there instead of "
            "127.0.0.1, serve joins, and print the command other machines join with.",
        ),
    ] = "",
    join_port: Annotated[
        int, typer.Option("--join-port", help="With --listen: the join service's port.")
    ] = 7443,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Plaintext everywhere (no CA, no client certificates, etcd without auth): "
            "for development on one machine only.",
        ),
    ] = False,
    node_id: Annotated[str, typer.Option("--node-id", help="The agent's node id.")] = "",
    threads: Annotated[int, typer.Option("--threads", help="Engine threads (0: its default).")] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for the model.")
    ] = 600.0,
    kv_ram_gib: Annotated[
        float,
        typer.Option("--kv-ram-gib", help="The node's KV store: RAM tier in GiB (0: no store)."),
    ] = 1.0,
    kv_ssd_gib: Annotated[
        float,
        typer.Option("--kv-ssd-gib", help="Its SSD tier, under the state dir (0: RAM only)."),
    ] = 2.0,
    metrics_port: Annotated[
        int, typer.Option("--metrics-port", help="The dashboard's port (cgn-metrics).")
    ] = 9092,
    engines: Annotated[
        str,
        typer.Option(
            "--engines",
            help="The engines serving the model, in profile order: cgn_infer, llama_cpp, "
            "mlx_lm, comma-separated. Several make a mixed fleet on this machine: one agent "
            "per engine (node <host>-<engine>, offering only it) and one replica of each.",
        ),
    ] = "cgn_infer",
    state_dir: Annotated[
        Path | None, flag("--state-dir", "Where up keeps etcd data, logs, up.json.")
    ] = None,
    config: Config = None,
) -> None:
    """Start a cluster on this machine (etcd, router, agent, cgn-metrics, a model) and wait
    until it serves.

    TLS by default: a private CA under the state dir, etcd with client certificates and
    RBAC, mutual TLS between the processes, HTTPS on the OpenAI port. Prints the OpenAI base
    URL, an API key, the CA file, the dashboard's URL and a curl line; with --listen, the
    command another machine joins with. `cgn-ctl down` stops it all.
    """
    from cgn_ctl import up as up_mod

    settings = load_service_settings(CtlSettings, "ctl", config, {})
    opts = up_mod.UpOptions(
        state_dir=state_dir or settings.state_dir,
        model=model,
        name=name,
        port=port,
        admin_port=admin_port,
        agent_port=agent_port,
        etcd=etcd,
        etcd_port=etcd_port,
        join=join,
        token=token,
        ca_hash=ca_hash,
        insecure=insecure,
        listen=listen,
        join_port=join_port,
        threads=threads,
        timeout_s=timeout,
        node_id=node_id,
        kv_ram_gib=kv_ram_gib,
        kv_ssd_gib=kv_ssd_gib,
        metrics_port=metrics_port,
        engines=tuple(e.strip() for e in engines.split(",") if e.strip()),
    )
    try:
        done = up_mod.up(opts, lambda msg: typer.echo(msg, err=True))
    except up_mod.Refused as exc:  # nothing was started
        fail(exc.message, EXIT_USAGE)
    except CognitoraError as exc:
        fail(f"{exc.message} (what started is listed by `cgn-ctl status`; `cgn-ctl down` stops it)")
    if done.joined:
        typer.echo(f"node {done.node} joined the cluster at {done.etcd}")
        return
    typer.echo(f"OpenAI API: {done.url}\nAPI key:    {done.key}\nmodel:      {done.model}")
    if len(done.engines) > 1:
        typer.echo(f"engines:    {', '.join(done.engines)} (nodes {', '.join(done.nodes)})")
    typer.echo(f"etcd:       {done.etcd}")
    typer.echo(f"router admin: {done.router_admin} (/metrics, /endpoints)")
    typer.echo(f"agent admin:  {done.agent_admin}")
    typer.echo(f"dashboard:    {done.dashboard}")
    if done.ca_file:
        typer.echo(f"CA:           {done.ca_file} ({done.ca_hash})")
    if done.join_url:
        typer.echo("\njoin another machine (one use, 24 h; `cgn-ctl tokens create` makes more):")
        typer.echo(done.join_command())
    cacert = f"--cacert {done.ca_file} " if done.ca_file else ""
    typer.echo(
        f"\ncurl -s {cacert}{done.url}/chat/completions -H 'Authorization: Bearer {done.key}' "
        f'-H \'Content-Type: application/json\' -d \'{{"model": "{done.model}", '
        f'"messages": [{{"role": "user", "content": "Say hi"}}]}}\''
    )
    if done.ca_file:
        typer.echo(
            f'openai.OpenAI(base_url="{done.url}", api_key="{done.key}", '
            f'http_client=httpx.Client(verify=ssl.create_default_context(cafile="{done.ca_file}")))'
        )


@app.command()
def down(
    state_dir: Annotated[Path | None, flag("--state-dir", "The state dir `up` used.")] = None,
    config: Config = None,
) -> None:
    """Stop everything `cgn-ctl up` started (and the engines its agent ran), by recorded pid."""
    from cgn_ctl import upstate

    settings = load_service_settings(CtlSettings, "ctl", config, {})
    try:
        stopped = upstate.down(
            state_dir or settings.state_dir, lambda msg: typer.echo(msg, err=True)
        )
    except CognitoraError as exc:
        fail(exc.message)
    typer.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command("install-units")
def install_units(
    directory: Annotated[Path, typer.Option("--dir", help="Where to write the units.")] = Path(
        "/etc/systemd/system"
    ),
    user: Annotated[
        str, typer.Option("--user", help="The account the services run as.")
    ] = "cognitora",
    with_etcd: Annotated[
        bool, typer.Option("--with-etcd", help="Also a unit for the embedded etcd.")
    ] = False,
    pki: Annotated[
        Path | None,
        typer.Option(
            "--pki",
            help="A PKI directory (as `cgn-ctl up` keeps in <state>/pki; /etc/cognitora/pki "
            "under systemd): each service gets its TLS settings from its leaf there, etcd "
            "serves HTTPS with client certificates. Needs --node.",
        ),
    ] = None,
    node: Annotated[str, typer.Option("--node", help="With --pki: this machine's node id.")] = "",
) -> None:
    """Write systemd units for the installed executables (then: systemctl daemon-reload)."""

    from cgn_core import executables
    from cgn_core.errors import ConfigError
    from cgn_ctl import units

    try:
        paths = {name: Path(executables.require(name)) for name in units.EXECUTABLES}
    except ConfigError as exc:
        fail(exc.message, EXIT_USAGE)

    etcd = None
    if with_etcd:
        from cgn_core.etcd.local import find_etcd_binary

        try:
            etcd = find_etcd_binary()
        except ConfigError as exc:
            fail(exc.message, EXIT_USAGE)
    identity = None
    if pki is not None or node:
        if pki is None or not node:
            fail("--pki and --node go together", EXIT_USAGE)
        pki = pki.resolve()
        if not (pki / "ca.pem").is_file():
            fail(f"--pki {pki}: no ca.pem there", EXIT_USAGE)
        missing = units.missing_leaves(pki, node, with_etcd)
        if with_etcd and not (pki / "etcd.pem").is_file():
            fail(f"--with-etcd --pki: no etcd.pem in {pki}", EXIT_USAGE)
        for what in missing:
            typer.echo(f"no TLS settings for {what}: not in {pki}", err=True)
        identity = (pki, node)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in units.render(paths, etcd, user, identity).items():
            (directory / name).write_text(text)
            typer.echo(f"wrote {directory / name}")
    except OSError as exc:
        fail(f"{directory}: {exc.strerror}")


main = run(app)
