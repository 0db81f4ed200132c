"""The level-triggered pass: every `resync_s`, every resource reconciled again (what a missed
event, an etcd that was down, a fallback created later or a child deleted by hand needs),
one resource's failure never skipping the others."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf

from cgn_core.errors import CognitoraError
from cgn_operator.clusters import reconcile_cluster
from cgn_operator.crds import API_VERSION, CLUSTER, MODEL
from cgn_operator.kube import Kube, KubeError, object_path
from cgn_operator.models import model_name, reconcile_model
from cgn_operator.state import State

log = logging.getLogger(__name__)


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
