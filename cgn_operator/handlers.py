"""kopf handlers: CognitoraCluster -> children, CognitoraModel -> the catalog in etcd.

Everything is level-triggered: a change handler (create, update, resume) reacts at once,
and a timer every `resync_s` runs the same reconcile again, so a missed event, an etcd
that was down, a fallback that named a model not yet created, or a child someone deleted
by hand all mend on the next pass.

    CognitoraModel m ──create/update/resume/timer──> parse_model ─bad─> status InvalidSpec
                                                          │              + Warning Event
                                                          v
                                  store.apply_owned (check_catalog over the whole catalog,
                                  owner record {kind, namespace, name, uid}) ─> etcd
                                                          │
                       status <── views.model_replicas <──┘ (one shared snapshot per cluster)

    deleted ──watch event──> store.delete_owned(name, uid); the cluster's timer sweeps any
                             owned entry whose resource is gone (missed while we were down)

No finalizers: children carry owner references and Kubernetes' garbage collector removes
them; a deleted model's catalog entry goes by the watch event or the sweep. So deleting a
namespace never waits on this operator, running or not. Status and progress live in the
resources themselves (annotations under cognitora.io/), so a restarted or replacement
operator picks up where the last one stopped.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import kopf
import yaml

from cgn_control import store
from cgn_control.catalog import CatalogError, ModelSpec, parse_model
from cgn_control.cluster import Snapshot
from cgn_control.cluster_reader import read_snapshot
from cgn_core import pki
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.etcd import EtcdClient
from cgn_core.files import atomic_write_text
from cgn_core.records import RecordLog
from cgn_core.settings import EtcdSettings, TlsSettings
from cgn_operator import children, status
from cgn_operator.crds import API_VERSION, CLUSTER, CLUSTER_LABEL, GROUP, MODEL, VERSION, model_doc
from cgn_operator.kube import Kube, KubeError, object_path
from cgn_operator.lease import Lease
from cgn_operator.settings import OperatorSettings

log = logging.getLogger(__name__)
Body = Mapping[str, Any]
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


# ---- etcd per cluster --------------------------------------------------------------------------


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


# ---- which cluster a model belongs to ----------------------------------------------------------


def cluster_of(model: Body, clusters: Any, default_image: str) -> children.Cluster:
    """The model's cluster: the one its cognitora.io/cluster label names, else the namespace's
    only one. SpecError says why there is none."""
    meta = model.get("metadata", {})
    ns = meta.get("namespace") or "default"
    bodies = list(clusters.get(ns, [])) if clusters is not None else []
    want = (meta.get("labels") or {}).get(CLUSTER_LABEL)
    if want:
        bodies = [b for b in bodies if b.get("metadata", {}).get("name") == want]
        if not bodies:
            raise children.SpecError(
                f"metadata.labels.{CLUSTER_LABEL}: no CognitoraCluster {want!r} in namespace {ns}"
            )
    elif len(bodies) != 1:
        found = "none" if not bodies else f"{len(bodies)}"
        raise children.SpecError(
            f"metadata.labels.{CLUSTER_LABEL}: namespace {ns} has {found} "
            "CognitoraClusters; label the model with the one it belongs to"
        )
    return children.cluster_from(bodies[0], default_image)


def model_name(body: Body) -> str:
    spec = body.get("spec")
    named = spec.get("name") if isinstance(spec, Mapping) else None
    return str(named or body["metadata"]["name"])


def owner_of(body: Body) -> dict[str, str]:
    meta = body["metadata"]
    return {
        "kind": MODEL.kind,
        "namespace": str(meta.get("namespace") or "default"),
        "name": str(meta["name"]),
        "uid": str(meta.get("uid") or ""),
    }


# ---- reconcile ---------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_status(body: Body, patch: kopf.Patch, new: dict[str, Any]) -> dict[str, Any]:
    """Write `new` (conditions with times merged) into `patch` if it differs from the body's."""
    old = body.get("status") or {}
    gen = int(body.get("metadata", {}).get("generation") or 0)
    new = {
        **new,
        "observedGeneration": gen,
        "conditions": status.merge_conditions(
            old.get("conditions"), new["conditions"], _now(), gen
        ),
    }
    if any(old.get(k) != v for k, v in new.items()):
        patch.status.update(new)
    return new


async def reconcile_model(state: State, body: kopf.Body, patch: kopf.Patch, clusters: Any) -> None:
    name = model_name(body)
    spec: ModelSpec | None = None
    error: tuple[str, str] | None = None
    snap: Snapshot | None = None
    try:
        c = cluster_of(body, clusters, state.settings.image)
        raw = body.get("spec") or {}
        if not isinstance(raw, Mapping):  # what an API server without the CRD's schema allows
            raise children.SpecError("spec: expected a mapping (the catalog's model fields)")
        spec = parse_model(model_doc(body["metadata"], raw))
        name = spec.name
        client = await cluster_etcd(state, c)
        seen = await view(state, c, client)
        current = seen.snap.models.get(name) if seen else None
        mine = seen is not None and seen.owners.get(name) == owner_of(body)
        as_wanted = mine and current is not None and current.to_json() == spec.to_json()
        # not already as wanted in the (recent) view: the checked, guarded write
        if not as_wanted and await store.apply_owned(client, spec, owner_of(body)):
            log.info("model %s: written to the catalog of %s/%s", name, c.namespace, c.name)
            state.snaps.pop(c.key, None)
            seen = await view(state, c, client)
        snap = seen.snap if seen else None
    except (CatalogError, children.SpecError) as exc:
        error = ("InvalidSpec", f"spec.{exc}" if isinstance(exc, CatalogError) else str(exc))
    except store.NotYours as exc:
        error = ("Conflict", exc.message)
    except (CognitoraError, KubeError) as exc:
        error = ("CatalogUnavailable", exc.message)
    old = (body.get("status") or {}).get("catalog")
    new = _set_status(body, patch, status.model_status(spec, error, snap, name))
    if error is not None and old != new.get("catalog"):
        await state.kube().warn(body, error[0], error[1])


async def reconcile_cluster(state: State, body: kopf.Body, patch: kopf.Patch, models: Any) -> None:
    kube = state.kube()
    problem: tuple[str, str] | None = None
    snap: Snapshot | None = None
    etcd = ""
    try:
        c = children.cluster_from(body, state.settings.image)
        etcd = ",".join(c.endpoints())
        objs = children.children(c)
        if c.tls:
            ca = await cluster_ca(state, c)
            nodes = [
                n["metadata"]["name"]
                for n in await kube.items("/api/v1/nodes")
                if children.selected(c, n["metadata"].get("labels") or {})
            ]
            names = [f"{c.name}-tls-router", f"{c.name}-tls-nodes", f"{c.name}-tls-etcd"]
            current = {}
            for n in names:
                doc = await kube.get(object_path("v1", "secrets", c.namespace, n))
                current[n] = (doc or {}).get("data") or {}
            objs = children.secrets(c, ca, nodes, current, dt.datetime.now(dt.UTC)) + objs
        for obj in objs:
            await kube.apply(obj)
        client = await cluster_etcd(state, c)
        seen = await view(state, c, client)
        snap = seen.snap if seen else None
        if snap is not None and models is not None:
            await sweep(client, c, models)
        router = await kube.get(
            object_path("apps/v1", "deployments", c.namespace, f"{c.name}-router")
        )
        agents = await kube.get(
            object_path("apps/v1", "daemonsets", c.namespace, f"{c.name}-agent")
        )
        new = status.cluster_status(
            (router or {}).get("status"),
            (agents or {}).get("status"),
            c.router_replicas,
            snap,
            etcd,
        )
    except (children.SpecError, pki.PkiError) as exc:
        problem = ("InvalidSpec", str(exc))
    except KubeError as exc:  # a child the API server refused (RBAC, a webhook, a quota)
        problem = ("ApplyFailed", exc.message)
    except CognitoraError as exc:  # etcd refused the sweep
        problem = ("EtcdUnavailable", exc.message)
    if problem is not None:
        new = status.cluster_status(None, None, 0, None, etcd, problem)
        conds = (body.get("status") or {}).get("conditions") or []
        old: Mapping[str, Any] = next((x for x in conds if x.get("type") == "Ready"), {})
        if old.get("message") != problem[1]:
            await kube.warn(body, *problem)
    _set_status(body, patch, new)


async def sweep(client: EtcdClient, c: children.Cluster, models: Any) -> list[str]:
    """Delete the catalog entries this operator wrote for CognitoraModels that are gone (or
    renamed their model); `models` is the index (namespace, name) -> [(uid, model name)]."""
    gone = []
    for model, owner in (await store.owners(client)).items():
        if owner.get("kind") != MODEL.kind or owner.get("namespace") != c.namespace:
            continue
        live = list(models.get((owner.get("namespace"), owner.get("name")), []))
        if (owner.get("uid"), model) in live:
            continue
        if await store.delete_owned(client, model, owner.get("uid")):
            log.info(
                "model %s: its CognitoraModel %s/%s is gone; deleted from the catalog",
                model,
                owner.get("namespace"),
                owner.get("name"),
            )
            gone.append(model)
    return gone


# ---- the registry ------------------------------------------------------------------------------


def build(state: State) -> kopf.OperatorRegistry:
    """A registry with every handler bound to `state` (no module-level registry: tests run
    several operators in one process)."""
    reg = kopf.OperatorRegistry()
    cl, mo = (GROUP, VERSION, CLUSTER.plural), (GROUP, VERSION, MODEL.plural)

    @kopf.on.login(registry=reg)
    def login_(**_: Any) -> kopf.ConnectionInfo | None:
        return state.info  # the credentials `start` logged in with: one identity

    @kopf.on.startup(registry=reg)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING  # Events for problems, not for every pass
        settings.watching.server_timeout = 300
        # the namespaces are exact names: no listing of namespaces (no RBAC for it either)
        settings.scanning.disabled = True

    @kopf.on.cleanup(registry=reg)
    async def cleanup(**_: Any) -> None:
        for task in state.tasks:
            task.cancel()

    @kopf.index(*cl, registry=reg, id="clusters")
    def clusters(**kw: Any) -> dict[str, dict[str, Any]]:
        body = kw["body"]
        return {kw["namespace"]: {"metadata": dict(body.metadata), "spec": dict(body.spec)}}

    async def on_model(**kw: Any) -> None:
        await reconcile_model(state, kw["body"], kw["patch"], kw["clusters"])

    async def on_cluster(**kw: Any) -> None:
        await reconcile_cluster(state, kw["body"], kw["patch"], None)

    for fn, res in ((on_model, mo), (on_cluster, cl)):
        kopf.on.create(*res, registry=reg, id="reconcile")(fn)
        kopf.on.update(*res, registry=reg, id="reconcile", field="spec")(fn)
        kopf.on.resume(*res, registry=reg, id="reconcile")(fn)

    @kopf.on.startup(registry=reg)
    async def start_resync(**_: Any) -> None:
        # started from kopf's startup so that it stops with the operator
        state.tasks.append(asyncio.create_task(resync_loop(state), name="resync"))

    @kopf.on.event(*mo, registry=reg)
    async def on_model_event(**kw: Any) -> None:
        if kw["type"] != "DELETED":
            return
        body = kw["body"]
        try:
            c = cluster_of(body, kw["clusters"], state.settings.image)
            client = await cluster_etcd(state, c)
            if await store.delete_owned(client, model_name(body), body.metadata.uid):
                log.info("model %s: deleted from the catalog", model_name(body))
                state.snaps.pop(c.key, None)
        except (children.SpecError, CognitoraError, KubeError) as exc:
            log.warning(
                "model %s: not deleted now (%s); the cluster's sweep will", model_name(body), exc
            )

    return reg


async def resync(state: State) -> None:
    """One level-triggered pass over every resource (what a missed event, an etcd that was
    down, a fallback created later, or a child deleted by hand needs)."""
    kube, ns = state.kube(), state.settings.namespace or None
    cluster_bodies = await kube.items(object_path(API_VERSION, CLUSTER.plural, ns))
    model_bodies = await kube.items(object_path(API_VERSION, MODEL.plural, ns))
    by_ns: dict[str, list[dict[str, Any]]] = {}
    for b in cluster_bodies:
        by_ns.setdefault(b.get("metadata", {}).get("namespace") or "default", []).append(b)
    live: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for b in model_bodies:
        meta = b.get("metadata", {})
        key = (meta.get("namespace") or "default", meta.get("name", ""))
        live.setdefault(key, []).append((meta.get("uid", ""), model_name(b)))
    for plural, bodies in ((CLUSTER.plural, cluster_bodies), (MODEL.plural, model_bodies)):
        for raw in bodies:
            patch = kopf.Patch()
            body = kopf.Body(cast(Any, raw))
            try:  # one object's failure must not skip the others
                if plural == CLUSTER.plural:
                    await reconcile_cluster(state, body, patch, live)
                else:
                    await reconcile_model(state, body, patch, by_ns)
                await _write_status(kube, raw, plural, patch)
            except (CognitoraError, KubeError) as exc:
                log.warning("resync: %s %s: %s", plural, raw["metadata"].get("name"), exc.message)


async def _write_status(kube: Kube, raw: Mapping[str, Any], plural: str, patch: kopf.Patch) -> None:
    if patch.get("status"):
        meta = raw["metadata"]
        path = object_path(API_VERSION, plural, meta.get("namespace"), meta["name"])
        await kube.patch_status(path, patch["status"])


async def resync_loop(state: State) -> None:
    while True:
        await asyncio.sleep(state.settings.resync_s)
        try:
            await resync(state)
        except (CognitoraError, KubeError) as exc:
            log.warning("resync: %s", exc.message)
        except Exception:  # NOTE: top of the loop: a bug in one pass must not end resyncing
            log.exception("resync: pass failed")


def _identity() -> str:
    return os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"


def login() -> kopf.ConnectionInfo:
    settings = kopf.OperatorSettings()
    try:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
    except (kopf.LoginError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = os.environ.get("KUBECONFIG") or "the kubeconfig"
        raise ConfigError(f"{where}: not a usable kubeconfig ({first})") from None
    if info is None:
        raise ConfigError(
            "no Kubernetes credentials: not in a pod and no kubeconfig "
            "(--kubeconfig, $KUBECONFIG or ~/.kube/config)"
        )
    return info


async def start(
    state: State,
    *,
    liveness: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    """Campaign for the Lease (unless standalone), then run the handlers and the resync loop
    until `stop_flag` is set, the process is signalled, or the Lease is lost (LeaseLost)."""
    ns = state.settings.namespace
    stop = stop_flag or asyncio.Event()
    state.info = login()
    keeper: asyncio.Task[None] | None = None
    try:
        if not state.settings.standalone:
            lease = Lease(
                state.kube(),
                ns or "cognitora",
                state.settings.lease,
                _identity(),
                state.settings.lease_ttl_s,
            )
            await lease.campaign()
            keeper = asyncio.create_task(lease.keep())
            keeper.add_done_callback(lambda _: stop.set())
        await kopf.operator(
            registry=build(state),
            clusterwide=not ns,
            namespaces=[ns] if ns else (),
            standalone=True,
            liveness_endpoint=liveness,
            stop_flag=stop,
            ready_flag=ready_flag,
        )
    finally:
        lost = keeper is not None and keeper.done() and not keeper.cancelled()
        if keeper is not None:
            keeper.cancel()
        await state.close()
    if lost:
        raise LeaseLost("lost the leader Lease; exiting so that a fresh candidate campaigns")


class LeaseLost(CognitoraError):
    """This operator no longer leads."""
