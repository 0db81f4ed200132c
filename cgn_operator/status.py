"""Status of the custom resources from what etcd and the children report (pure).

A CognitoraModel:
* `Ready`: True once the model is in the catalog and at least `replicas.min` replicas
  are Ready (a disaggregated model's pools add up). `desiredReplicas` is the
  autoscaler's target (its record in etcd; `min` before its first decision).
* `Degraded`: True while a placed replica is Failed, or fewer than `min` are Ready
  after some were (serving below strength); False while it is only coming up.
A model the catalog refused is Ready False with reason InvalidSpec (or Conflict, or
CatalogUnavailable), its message the field path, and `catalog` says the same.

A CognitoraCluster: `Ready` when etcd answers and at least one router is ready;
`Degraded` when fewer routers or agents are ready than desired.

A condition's lastTransitionTime moves only when its status changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cgn_control.decide.catalog import ModelSpec, pool_record
from cgn_control.decide.cluster import Snapshot
from cgn_control.decide.views import model_replicas

Condition = dict[str, Any]


def condition(type_: str, ok: bool, reason: str, message: str = "") -> Condition:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


def merge_conditions(
    old: Any, new: Sequence[Condition], now: str, generation: int
) -> list[Condition]:
    """`new` with each condition's lastTransitionTime kept from `old` where its status is
    the same, `now` where it changed."""
    before = (
        {c.get("type"): c for c in old if isinstance(c, Mapping)} if isinstance(old, list) else {}
    )
    out = []
    for c in new:
        prev = before.get(c["type"])
        same = prev is not None and prev.get("status") == c["status"]
        when = prev.get("lastTransitionTime", now) if same and prev else now
        out.append({**c, "lastTransitionTime": when, "observedGeneration": generation})
    return out


def model_status(
    spec: ModelSpec | None, error: tuple[str, str] | None, snap: Snapshot | None, name: str
) -> dict[str, Any]:
    """The status fields (conditions without times: see merge_conditions). `error`: (reason,
    message) when the model is not in the catalog; `snap`: None when etcd did not answer."""
    desired = 0 if spec is None else target(spec, snap)
    if error is not None:
        reason, message = error
        return {
            "model": name,
            "desiredReplicas": desired,
            "placedReplicas": 0,
            "readyReplicas": 0,
            "catalog": message,
            "conditions": [
                condition("Ready", False, reason, message),
                condition("Degraded", False, reason, message),
            ],
        }
    assert spec is not None
    if snap is None:
        msg = "etcd did not answer; the catalog entry is written, replicas unknown"
        return {
            "model": name,
            "desiredReplicas": desired,
            "catalog": "Written",
            "conditions": [condition("Ready", False, "CatalogUnavailable", msg)],
        }
    r = model_replicas(snap, name)
    # NOTE: Ready and Degraded measure against min, what the user asked to always have: a
    # model the autoscaler is growing from 1 to 3 is serving, not degraded
    floor = sum(lo for _, lo, _ in spec.wants())
    ready = r.ready >= floor
    if r.failed:
        degraded, why = True, f"{r.failed} replica(s) failed: " + "; ".join(r.reasons[:3])
    elif 0 < r.ready < floor:
        degraded, why = True, f"{r.ready} of {floor} replicas ready"
    else:
        degraded, why = False, ""
    progress = f"{r.ready}/{desired} ready, {r.placed} placed"
    progress += f" (min {floor})" if desired != floor else ""
    return {
        "model": name,
        "desiredReplicas": desired,
        "placedReplicas": r.placed,
        "readyReplicas": r.ready,
        "catalog": "Written",
        "conditions": [
            condition("Ready", ready, "ReplicasReady" if ready else "ReplicasNotReady", progress),
            condition(
                "Degraded",
                degraded,
                "ReplicasFailed" if r.failed else "BelowDesired" if degraded else "AsDesired",
                why,
            ),
        ],
    }


def target(spec: ModelSpec, snap: Snapshot | None) -> int:
    """Replicas the model should have now: per pool, the autoscaler's last target (its
    record in etcd, within the pool's bounds), or the pool's min before any decision."""
    total = 0
    for role, lo, hi in spec.wants():
        record = snap.scaling.get(pool_record(spec.name, spec, role)) if snap else None
        total += lo if record is None else min(hi, max(lo, record.desired))
    return total


def _count(status: Mapping[str, Any] | None, ready_key: str, desired_key: str) -> tuple[int, int]:
    st = status or {}
    return int(st.get(ready_key) or 0), int(st.get(desired_key) or 0)


def cluster_status(
    router: Mapping[str, Any] | None,
    agents: Mapping[str, Any] | None,
    routers_wanted: int,
    snap: Snapshot | None,
    etcd: str,
    problem: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """From the router Deployment's and the agent DaemonSet's status, and a snapshot (None:
    etcd did not answer). `problem`: (reason, message) when the children could not be
    written (InvalidSpec, ApplyFailed)."""
    r_ready, _ = _count(router, "readyReplicas", "replicas")
    a_ready, a_want = _count(agents, "numberReady", "desiredNumberScheduled")
    if problem:
        ready = condition("Ready", False, *problem)
    elif snap is None:
        ready = condition("Ready", False, "EtcdUnavailable", f"etcd at {etcd} did not answer")
    elif r_ready < 1:
        ready = condition("Ready", False, "NoRouterReady", "no router is ready yet")
    else:
        ready = condition("Ready", True, "Serving", f"{r_ready} router(s) ready")
    short = r_ready < routers_wanted or a_ready < a_want
    degraded = condition(
        "Degraded",
        short and not problem,
        "BelowDesired" if short else "AsDesired",
        f"routers {r_ready}/{routers_wanted}, agents {a_ready}/{a_want}",
    )
    return {
        "routers": f"{r_ready}/{routers_wanted}",
        "agents": f"{a_ready}/{a_want}",
        "nodes": 0 if snap is None else len(snap.nodes),
        "models": 0 if snap is None else len(snap.models),
        "etcd": etcd,
        "conditions": [ready, degraded],
    }
