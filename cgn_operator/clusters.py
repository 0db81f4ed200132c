"""CognitoraCluster -> its children (ConfigMap, etcd, router, agents, metrics, TLS Secrets)
by server-side apply, the sweep of its catalog, and its status."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import kopf

from cgn_control.decide.cluster import Snapshot
from cgn_core import pki
from cgn_core.errors import CognitoraError
from cgn_operator import children, gateway, status
from cgn_operator.kube import KubeError, object_path
from cgn_operator.models import Body, Models, set_status, sweep
from cgn_operator.state import State, cluster_ca, cluster_etcd, view


async def reconcile_cluster(
    state: State, body: Body, patch: kopf.Patch, models: Models | None
) -> None:
    kube = state.kube()
    problem: tuple[str, str] | None = None
    snap: Snapshot | None = None
    etcd = ""
    try:
        c = children.cluster_from(body, state.settings.image)
        etcd = ",".join(c.endpoints())
        objs = children.children(c) + gateway.objects(c)
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
    set_status(body, patch, new)
