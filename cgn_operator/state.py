"""What the operator's handlers share, and each cluster's etcd as they reach it.

`State` holds the API client, one etcd client per CognitoraCluster and a short-lived view
(snapshot and owner records) of each cluster's etcd. `cluster_etcd` makes a cluster's client
from its Secrets (an external etcd's, or a certificate issued from the cluster's CA) and
keeps it, reading the material again every CREDENTIALS_S; `view` reads a cluster's etcd once
for every handler within `snapshot_ttl_s`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import kopf

from cgn_control import store
from cgn_control.cluster_reader import read_snapshot
from cgn_control.decide.cluster import Snapshot
from cgn_core import pki
from cgn_core.errors import CognitoraError
from cgn_core.etcd import EtcdClient
from cgn_core.files import atomic_write_text
from cgn_core.records import RecordLog
from cgn_core.settings import EtcdSettings, TlsSettings
from cgn_operator import children
from cgn_operator.kube import Kube, object_path
from cgn_operator.settings import OperatorSettings

log = logging.getLogger(__name__)
CREDENTIALS_S = 300.0  # how long a cluster's etcd TLS material is trusted before a re-read


@dataclass
class State:
    """What the handlers share: the API client, one etcd client per cluster, snapshots."""

    settings: OperatorSettings
    info: kopf.ConnectionInfo | None = None
    kube_: Kube | None = None
    etcd: dict[str, Held] = field(default_factory=dict)  # by cluster (namespace/name)
    snaps: dict[str, tuple[float, View]] = field(default_factory=dict)
    records: RecordLog = field(default_factory=lambda: RecordLog(log))
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cgn-operator-")))
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def kube(self) -> Kube:
        if self.kube_ is None:
            if self.info is None:
                raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
            self.kube_ = Kube(self.info)
        return self.kube_

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.kube_ is not None:
            await self.kube_.close()
        for held in self.etcd.values():
            await held.client.close()
        shutil.rmtree(self.tmp, ignore_errors=True)  # the etcd client keys written for TLS


async def _secret(
    state: State, namespace: str, name: str, keys: tuple[str, ...], field_: str
) -> dict[str, bytes]:
    doc = await state.kube().get(object_path("v1", "secrets", namespace, name))
    if doc is None:
        raise children.SpecError(f"{field_}: Secret {namespace}/{name} not found")
    data = doc.get("data") or {}
    missing = [k for k in keys if k not in data]
    if missing:
        raise children.SpecError(f"{field_}: Secret {name} has no {', '.join(missing)}")
    return {k: base64.b64decode(data[k]) for k in keys}


async def cluster_ca(state: State, c: children.Cluster) -> pki.Pair:
    raw = await _secret(state, c.namespace, c.ca_secret, ("ca.pem", "ca.key"), "spec.ca.secretName")
    return pki.from_pem(raw["ca.pem"], raw["ca.key"], f"Secret {c.ca_secret}")


async def cluster_etcd(state: State, c: children.Cluster) -> EtcdClient:
    """A client for the cluster's etcd: with the external etcd's Secret, or a certificate
    this operator issues itself from the cluster's CA (CN cgn-operator), or plaintext.
    Kept per cluster; its TLS material is read again every CREDENTIALS_S (a rotated CA or
    etcd Secret is picked up then), not on every reconcile."""
    ident, now = c.key, time.monotonic()
    where = repr((c.endpoints(), c.etcd_tls_secret, c.ca_secret))
    held = state.etcd.get(ident)
    if held is not None and held.where == where and now - held.since < CREDENTIALS_S:
        return held.client
    files: dict[str, bytes] = {}
    if c.etcd_tls_secret:
        names = ("ca.pem", "cert.pem", "key.pem")
        files = await _secret(state, c.namespace, c.etcd_tls_secret, names, "spec.etcd.tlsSecret")
        material = b"".join(files.values())
    elif c.tls:
        ca = await cluster_ca(state, c)
        material = pki.to_pem(ca)[0].encode()
        if held is None or held.material != material:  # issue only for a new CA
            cert, key = pki.to_pem(pki.issue(ca, "cgn-operator", "ctl", usage="client"))
            files = {"ca.pem": material, "cert.pem": cert.encode(), "key.pem": key.encode()}
    else:
        material = b""
    if held is not None and held.where == where and held.material == material:
        state.etcd[ident] = replace(held, since=now)
        return held.client
    if held is not None:
        await held.client.close()
    tls = TlsSettings()
    if files:
        d = state.tmp / f"{c.namespace}.{c.name}"
        d.mkdir(mode=0o700, exist_ok=True)
        for name, data in files.items():
            atomic_write_text(d / name, data.decode(), mode=0o600)
        tls = TlsSettings(d / "ca.pem", d / "cert.pem", d / "key.pem")
    endpoints = tuple(e.split("://", 1)[-1] for e in c.endpoints())
    client = EtcdClient(EtcdSettings(endpoints=endpoints, timeout_s=5.0, tls=tls))
    state.etcd[ident] = Held(client, where, material, now)
    return client


@dataclass(frozen=True, slots=True)
class Held:
    """A cluster's etcd client, what it was made from, and when its material was last read."""

    client: EtcdClient
    where: str  # endpoints and the Secrets named
    material: bytes  # the CA or etcd Secret it was made with
    since: float


@dataclass(frozen=True, slots=True)
class View:
    """One read of a cluster's etcd: the snapshot and the catalog's owner records."""

    snap: Snapshot
    owners: Mapping[str, Mapping[str, str]]


async def view(state: State, c: children.Cluster, client: EtcdClient) -> View | None:
    """The cluster's view, shared for `snapshot_ttl_s` (a resync of 100 models reads etcd a
    few times, not 100); None when etcd does not answer."""
    ident, now = c.key, time.monotonic()
    held = state.snaps.get(ident)
    if held is not None and now - held[0] < state.settings.snapshot_ttl_s:
        return held[1]
    try:
        got = View(await read_snapshot(client, state.records), await store.owners(client))
    except CognitoraError as exc:
        log.warning("cluster %s: etcd: %s", ident, exc.message)
        return None
    state.snaps[ident] = (now, got)
    return got
