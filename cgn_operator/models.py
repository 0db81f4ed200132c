"""CognitoraModel -> the catalog in its cluster's etcd: which cluster a model belongs to,
the checked and owned write, its status, and the sweep of entries whose resource is gone."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from cgn_control import store
from cgn_control.decide.catalog import CatalogError, ModelSpec, parse_model
from cgn_control.decide.cluster import Snapshot
from cgn_core.errors import CognitoraError
from cgn_core.etcd import EtcdClient
from cgn_operator import children, status
from cgn_operator.crds import CLUSTER_LABEL, MODEL, model_doc
from cgn_operator.kube import KubeError
from cgn_operator.state import State, cluster_etcd, view

log = logging.getLogger(__name__)
Body = Mapping[str, Any]
# namespace -> its CognitoraCluster bodies (kopf's index, or the resync's own listing)
Clusters = Mapping[str, Iterable[Body]]
# (namespace, name) of a CognitoraModel -> [(uid, model name)] (what is alive now)
Models = Mapping[tuple[str, str], Iterable[tuple[str, str]]]


def cluster_of(model: Body, clusters: Clusters | None, default_image: str) -> children.Cluster:
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


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_status(body: Body, patch: kopf.Patch, new: dict[str, Any]) -> dict[str, Any]:
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


async def reconcile_model(
    state: State, body: Body, patch: kopf.Patch, clusters: Clusters | None
) -> None:
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
    new = set_status(body, patch, status.model_status(spec, error, snap, name))
    if error is not None and old != new.get("catalog"):
        await state.kube().warn(body, error[0], error[1])


async def sweep(client: EtcdClient, c: children.Cluster, models: Models) -> list[str]:
    """Delete the catalog entries this operator wrote for CognitoraModels that are gone (or
    renamed their model); `models` is the index (namespace, name) -> [(uid, model name)]."""
    gone = []
    for model, owner in (await store.owners(client)).items():
        if owner.get("kind") != MODEL.kind or owner.get("namespace") != c.namespace:
            continue
        live = list(models.get((c.namespace, owner.get("name", "")), []))
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


async def forget_model(state: State, body: Body, clusters: Clusters | None) -> None:
    """A CognitoraModel was deleted: delete the catalog entry it owns (the sweep does it
    later if this fails now)."""
    try:
        c = cluster_of(body, clusters, state.settings.image)
        client = await cluster_etcd(state, c)
        if await store.delete_owned(client, model_name(body), body["metadata"].get("uid")):
            log.info("model %s: deleted from the catalog", model_name(body))
            state.snaps.pop(c.key, None)
    except (children.SpecError, CognitoraError, KubeError) as exc:
        log.warning(
            "model %s: not deleted now (%s); the cluster's sweep will", model_name(body), exc
        )
