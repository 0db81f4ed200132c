"""What cgn-ctl's commands do against etcd; each returns plain data (the `--json` output).

Nothing here prints: cli.py renders. Every function takes an open EtcdClient.
"""

from __future__ import annotations

import dataclasses
import getpass
import socket
import time
from typing import Any

from cgn_control import store
from cgn_control.cluster_reader import read_snapshot
from cgn_control.decide.catalog import pool_label, pool_record
from cgn_control.decide.cluster import node_views
from cgn_control.decide.placement import Decision, place, rank_plan
from cgn_control.decide.views import (
    AdapterResidency,
    adapter_residency,
    model_replicas,
    node_states,
)
from cgn_core import keys, multinode
from cgn_core.errors import InvalidRequest, NotFound
from cgn_core.etcd import EtcdClient
from cgn_core.records import NodeInventory, Placement, ReplicaStatus


async def nodes(client: EtcdClient) -> list[dict[str, Any]]:
    snap = await read_snapshot(client)
    out = []
    for name, state in sorted(node_states(snap).items()):
        inv = snap.nodes.get(name, NodeInventory())
        cordon = snap.cordons.get(name)
        unhealthy = [
            {"index": a.index, "why": "; ".join(a.health)} for a in inv.accelerators if a.health
        ]
        out.append(
            {
                "node": name,
                "state": "draining"
                if cordon and cordon.drain
                else "cordoned"
                if cordon is not None
                else state,
                "reachable": state == "ready",
                "class": inv.node_class,
                "accelerators": len(inv.accelerators),
                "unhealthy": unhealthy,
                "engines": list(inv.engines),
                "replicas": sorted(r for n, r in snap.placements if n == name),
                "watts": inv.watts,
                "cpu": dict(inv.cpu),
            }
        )
    return out


async def models(client: EtcdClient) -> list[dict[str, Any]]:
    snap = await read_snapshot(client)
    held = await store.owners(client)
    out = []
    for name, spec in sorted(snap.models.items()):
        counts = model_replicas(snap, name)
        who = held.get(name)
        want = [snap.scaling.get(pool_record(name, spec, r)) for r, _, _ in spec.wants()]
        out.append(
            {
                "model": name,
                "min": sum(b.min for b in spec.pools.values()),
                "max": sum(b.max for b in spec.pools.values()),
                **(
                    {"pools": {r: b.to_json() for r, b in spec.pools.items()}}
                    if spec.disaggregated
                    else {}
                ),
                "placed": counts.placed,
                "ready": counts.ready,
                # the autoscaler's target (summed over pools); null before any decision
                "desired": None if None in want else sum(w.desired for w in want if w is not None),
                "aliases": list(spec.aliases),
                "fallbacks": list(spec.fallbacks),
                "profiles": [
                    f"{p.engine}@{p.accelerator}" + (f"×{p.devices}" if p.devices else "")
                    for p in spec.profiles
                ],
                # who may change it: a Kubernetes resource (cgn-operator), or null (cgn-ctl)
                "managed_by": store.describe_owner(who) if who else None,
            }
        )
    return out


async def get_model(client: EtcdClient, name: str) -> dict[str, Any]:
    doc = await client.get_json(keys.CATALOG + name)
    if doc is None:
        raise NotFound(f"model {name!r} is not in the catalog")
    return dict(doc)


async def replicas(client: EtcdClient, model: str | None = None) -> list[dict[str, Any]]:
    snap = await read_snapshot(client)
    states = node_states(snap)
    out = []
    for (node, replica), p in sorted(snap.placements.items()):
        if model and p.model != model:
            continue
        st = snap.statuses.get((node, replica))
        out.append(
            {
                "replica": replica,
                "node": node,
                "model": p.model,
                "engine": p.engine,
                "role": p.role,
                "devices": list(p.devices),
                "phase": st.phase if st else "Pending",
                "url": (st.url or None) if st else None,
                "restarts": st.restarts if st else 0,
                "reason": st.reason if st else "",
                "node_state": states.get(node, "unreachable"),
                "part": _part(p, st),
                "adapters": list(st.adapters) if st else [],
            }
        )
    return out


def _part(p: Placement, status: ReplicaStatus | None) -> str:
    """A multi-node replica's part as a person reads it: `head 0/2`, `stage 1/2 10.0.0.2:9101`
    (a cgn-infer pipeline), `rank 0/2 10.0.0.1:29500` (its rendezvous point), `rank 1/2`
    (vLLM, SGLang); "" for a replica on one node."""
    if not p.part.multi:
        return ""
    if p.engine in multinode.RANK_ENGINES:
        address = status.part.address if status and p.part.part == 0 else ""
        return f"rank {p.part.part}/{p.part.parts}" + (f" {address}" if address else "")
    if p.part.part == 0:
        return f"head 0/{p.part.parts}"
    address = status.part.address if status else ""
    return f"stage {p.part.part}/{p.part.parts}" + (f" {address}" if address else "")


async def explain(
    client: EtcdClient, name: str, role: str | None = None
) -> tuple[Decision, list[dict[str, Any]], list[AdapterResidency]]:
    """Where one more replica of model `name` (of its pool of `role`) would go now; for
    vLLM or SGLang across nodes, how each rank would launch; where its adapters are."""
    snap = await read_snapshot(client)
    spec = snap.models.get(name)
    if spec is None:
        raise NotFound(f"model {name!r} is not in the catalog")
    roles = [r for r, _, _ in spec.wants()]
    if role is not None and role not in roles:
        raise InvalidRequest(f"model {name!r} has no {role} pool (its pools: {', '.join(roles)})")
    sub = spec.for_role(role) if role else spec
    decision = place(sub, node_views(snap, node_states(snap)))
    return decision, rank_plan(sub, decision, snap.nodes), adapter_residency(snap, name)


async def explain_scaling(client: EtcdClient, name: str) -> dict[str, Any]:
    """The autoscaler's last decision for each pool of model `name` (the leader writes one
    record per pool under /cognitora/scaling/), with the model's bounds and policy. A target
    outside the pool's bounds (a forged or stale record: the leader never writes one) is
    shown clamped, with what the record said under `recorded_desired`."""
    snap = await read_snapshot(client)
    spec = snap.models.get(name)
    if spec is None:
        raise NotFound(f"model {name!r} is not in the catalog")
    pools = []
    for role, lo, hi in spec.wants():
        record = snap.scaling.get(pool_record(name, spec, role))  # checked, or left out
        pools.append(
            {
                "role": role if spec.disaggregated else "",
                "min": lo,
                "max": hi,
                "decision": _bounded(record.to_json(), lo, hi) if record is not None else None,
            }
        )
    policy = dataclasses.asdict(spec.scaling)
    return {"model": name, "policy": policy, "pools": pools}


def _bounded(decision: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """`decision` and its history with every target clamped to [lo, hi]; an entry whose
    record said otherwise keeps that under `recorded_desired`."""
    out = dict(decision)
    if not lo <= out["desired"] <= hi:
        out["recorded_desired"], out["desired"] = out["desired"], min(max(out["desired"], lo), hi)
    if "history" in out:
        out["history"] = [_bounded(h, lo, hi) for h in out["history"]]
    return out


async def cordon(
    client: EtcdClient, node: str, *, drain: bool = False, grace_s: float = 600.0, reason: str = ""
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "by": f"{getpass.getuser()}@{socket.gethostname()}",
        "since_unix": time.time(),
        "reason": reason,
    }
    if drain:
        doc |= {"drain": True, "grace_s": grace_s}
    await client.put_json(keys.CORDON + node, doc)
    return doc


async def node_exists(client: EtcdClient, node: str) -> bool:
    """Whether `node` is registered now or has placements (a node that is down still counts)."""
    if await client.get(keys.NODES + node) is not None:
        return True
    placed, _ = await client.get_prefix(f"{keys.PLACEMENTS}{node}/")
    return bool(placed)


async def uncordon(client: EtcdClient, node: str) -> bool:
    return await client.delete(keys.CORDON + node) > 0


async def replicas_on(client: EtcdClient, node: str) -> list[dict[str, Any]]:
    return [r for r in await replicas(client) if r["node"] == node]


async def status(client: EtcdClient) -> dict[str, Any]:
    snap = await read_snapshot(client)
    leader = await client.get(keys.RECONCILER_LEADER)
    unplaced = {}
    states = node_states(snap)
    for name, spec in sorted(snap.models.items()):
        for role, lo, _ in spec.wants():
            mine = [k for k, d in snap.placements.items() if spec.in_pool(d, role)]
            if len(mine) < lo:
                d = place(spec.for_role(role), node_views(snap, states))
                if not d.ok:
                    unplaced[pool_label(name, spec, role)] = d.explain()
    return {
        "leader": leader.value.decode() if leader else None,
        "nodes": await nodes(client),
        "models": await models(client),
        "unplaceable": unplaced,
    }
