"""The kopf registry: CognitoraCluster -> children (clusters.py), CognitoraModel -> the
catalog in etcd (models.py), the resync pass (resync.py), over shared state (state.py).

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
import logging
from typing import Any

import kopf

from cgn_operator.clusters import reconcile_cluster
from cgn_operator.crds import CLUSTER, GROUP, MODEL, VERSION
from cgn_operator.models import forget_model, reconcile_model
from cgn_operator.resync import resync_loop
from cgn_operator.state import State

log = logging.getLogger(__name__)


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
        if kw["type"] == "DELETED":
            await forget_model(state, kw["body"], kw["clusters"])

    return reg
