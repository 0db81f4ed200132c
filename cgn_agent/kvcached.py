"""The node's KV store (cgn-kvcached) as the agent sees it: run it, tell engines and routers.

Modes (`kvcached.mode`):
* `off`: no store; engines get no KV-store flags.
* `run`: the agent starts `cgn-kvcached serve` as its own child (gRPC on
  loopback: only this node's engines use it; the admin listener, with the
  event stream, on the engines' bind address), restarts it when it exits
  (with backoff; its SSD tier survives, its RAM tier does not) and stops it
  when the agent stops.
* `external`: a store already runs on this node (the `cgn-kvcached.service`
  unit) at `port`/`admin_port`; the agent only passes it on.

In `run` and `external` modes, cgn-infer engines get `--kvcached 127.0.0.1:port`
and, in their environment, the store's client token derived from the node
secret (cgn_core/kv/identity.py: only they may Put, Get and Lookup; blocks
move through shared memory: same host, same user), vLLM and SGLang
engines without a KV connector of their own get their built-in CPU offload
of `engine_offload_gib` (vLLM `--kv-offloading-backend native
--kv-offloading-size`, SGLang `--enable-hierarchical-cache --hicache-size`),
and while the store is up the agent publishes `/cognitora/kvcached/<node>`
(its address and its KV event stream, with the stream's bearer token) under
its lease, so routers weigh what the node's tiers hold.

Lifecycle of a `run` store:

    spawn ──ready file──▶ Serving (record published) ──exit──▶ Down (record withdrawn)
      ▲                                                          │
      └────────────────────────── backoff (1 s .. 30 s) ◀────────┘
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cgn_agent.publisher import Publisher
from cgn_agent.settings import NodeKvcachedSettings
from cgn_core import keys
from cgn_core.backoff import Backoff
from cgn_core.files import atomic_write_json
from cgn_core.kv.identity import StoreKeys, ensure_secret, read_secret
from cgn_core.process import (
    fingerprint,
    fingerprint_from_json,
    fingerprint_to_json,
    matches,
    stop_group,
    stop_pid_group,
)
from cgn_core.readiness import wait_ready_file
from cgn_core.settings import TlsSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What engines launched on this node are told, and what routers read from etcd."""

    address: str = ""  # host:port engines reach the store at; "" when off
    offload_gib: float = 0.0
    record: dict[str, str] | None = None
    client_token: str = ""  # engines present it (in their environment, never argv)
    secret_file: Path | None = None  # the store reads its keys here


def secret_path(s: NodeKvcachedSettings, state_dir: Path) -> Path | None:
    if s.mode == "run":
        return s.secret_file or state_dir / "kvcached.secret"
    return s.secret_file if s.mode == "external" else None


def plan(
    s: NodeKvcachedSettings, advertise: str, token: str, secret_file: Path | None = None
) -> StorePlan:
    """What engines and routers are told. Run mode creates the node secret when absent;
    a secret file that is unsafe or malformed is a ConfigError."""
    if s.mode == "off":
        return StorePlan(offload_gib=0.0)
    client = ""
    if secret_file is not None:
        make = ensure_secret if s.mode == "run" else read_secret
        client = StoreKeys.derive(make(secret_file)).client_token
    # NOTE: only engines on this node use the store (blocks move through shared memory), so
    # its gRPC listener stays on loopback; routers read its events from the admin listener.
    address = f"127.0.0.1:{s.port}"
    record = {
        "address": address,
        "events_url": f"http://{advertise}:{s.admin_port}/v1/kv/events",
        "events_token": token,
    }
    return StorePlan(address, s.engine_offload_gib, record, client, secret_file)


def argv(
    s: NodeKvcachedSettings,
    exe: str,
    bind_host: str,
    ready: Path,
    tls: TlsSettings | None,
    secret_file: Path | None = None,
) -> list[str]:
    out = [
        exe,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(s.port),
        "--admin-port",
        str(s.admin_port),
        "--ram-bytes",
        str(s.ram_bytes),
        "--set",
        f"admin.host={bind_host}",
        "--ready-file",
        str(ready),
    ]
    if secret_file is not None:
        out += ["--set", f"secret_file={secret_file}"]
    if s.ssd_dir is not None:
        out += ["--ssd-dir", str(s.ssd_dir), "--ssd-bytes", str(s.ssd_bytes)]
    if tls is not None:
        out += [
            "--set",
            f"tls.ca_file={tls.ca_file}",
            "--set",
            f"tls.cert_file={tls.cert_file}",
            "--set",
            f"tls.key_file={tls.key_file}",
        ]
    return out


def new_token() -> str:
    return secrets.token_urlsafe(24)


async def supervise(
    command: list[str],
    token: str,
    ready: Path,
    log_path: Path,
    publisher: Publisher,
    node: str,
    record: dict[str, str],
) -> None:
    """Run the store until cancelled, restarting it when it exits; publish its record while it
    serves. Cancellation stops it (SIGTERM, then SIGKILL)."""
    key = keys.KVCACHED + node
    backoff = Backoff(base=1.0, cap=30.0)
    env = {**os.environ, "CGN_KVCACHED_EVENTS_TOKEN": token}
    while True:
        proc = await asyncio.to_thread(_spawn, command, env, ready, log_path)
        try:
            try:
                await asyncio.to_thread(wait_ready_file, ready, 120.0, proc)
            except (TimeoutError, RuntimeError) as exc:
                log.error("cgn-kvcached did not start (%s); see %s", exc, log_path)
            else:
                log.info("cgn-kvcached serving at %s", record["address"])
                publisher.set(key, record)
                backoff.reset()
                code = await asyncio.to_thread(proc.wait)
                log.warning("cgn-kvcached exited with %s; see %s", code, log_path)
            publisher.delete(key)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    await asyncio.to_thread(stop_group, proc, 10.0)
        await asyncio.sleep(backoff.next())


def _spawn(
    command: list[str], env: dict[str, str], ready: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    record = ready.with_suffix(".process.json")  # the store's fingerprint, for a later agent
    _stop_leftover(record)
    ready.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    fp = fingerprint(proc.pid)
    if fp is not None:
        atomic_write_json(record, fingerprint_to_json(fp))
    return proc


def _stop_leftover(record: Path) -> None:
    """A store an agent killed with SIGKILL left running still holds the ports: stop it. Only
    the process its fingerprint names is signalled (a reused pid is not)."""
    try:
        fp = fingerprint_from_json(json.loads(record.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return
    if matches(fp):
        log.warning("stopping the cgn-kvcached (pid %d) a previous agent left running", fp.pid)
        stop_pid_group(fp)
