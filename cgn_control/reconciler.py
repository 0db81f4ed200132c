"""The control loop's decisions: desired replicas (catalog) vs actual (placements, nodes, statuses).

Pure: `reconcile(snapshot, memory, now, policy)` returns the placements to
delete and at most one placement to create; the leader's loop in control.py
reads a fresh snapshot from etcd before every pass and writes the actions.

Per pass, in order:
1. Node expiry in two stages. A node whose key is gone is *unreachable*
   (its replicas are kept: a network blip must not tear down serving
   replicas); after `lost_after_s` it is *lost* and its placements are deleted.
2. Placements of models no longer in the catalog are deleted.
3. Replica failure = whole-replica rebuild: a placement the agent refused, or
   one that failed `max_local_failures` times in a row on its node, is
   deleted, and the model waits a jittered exponential backoff before its
   next placement.
4. Drain: placements on a node cordoned with `drain` do not count toward
   the model's replicas, so replacements are placed elsewhere first; an
   original is deleted once the model has `min` Ready replicas off draining
   nodes, or when the drain's grace period is over. (The agent then
   withdraws the endpoint and stops the engine only after its requests in
   flight have finished.)
5. Scale: below `min` replicas (off draining and lost nodes), one placement
   is made with placement.place(); above `max`, one replica is deleted
   (not-Ready ones first).
The reconciler manages only the placements it wrote (`owner: reconciler`);
a placement written by hand is never moved or deleted, though the devices it
holds are not given to anything else.

Multi-node replicas (a cgn-infer layer pipeline, `nodes > 1`): one placement per
node under one replica id, each with its `pipeline` part (0: the head, which
alone counts as the replica and is routed to). Whatever deletes one part
deletes them all (a lost node, a failed part, a drain), so a replica is
rebuilt whole. Once every stage reports Ready with its address, the head's
placement gets the addresses (`pipeline.stages`); its agent starts the head
then, and again whenever a stage comes back elsewhere. Other engines' multi-node
profiles are left out until their agents can launch them.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cgn_control.catalog import ModelSpec, pool_label
from cgn_control.cluster import Key, Snapshot, views
from cgn_control.placement import Decision, NodeState, place
from cgn_core.net import is_host_port
from cgn_core.records import pipeline_part


@dataclass(frozen=True, slots=True)
class ReconcilerSettings:
    """The control loop (runs on the elected leader among routers; etcd discovery only)."""

    enabled: bool = True
    lease_ttl_s: int = 10  # leadership passes to another router this long after the leader dies
    interval_s: float = 1.0  # between passes (each reads a fresh snapshot)
    lost_after_s: float = 30.0  # a node unreachable this long is lost: its replicas are rebuilt
    max_local_failures: int = 5  # engine failures in a row on one node before a rebuild elsewhere
    rebuild_base_s: float = 2.0  # rebuild backoff: min(cap, base * 2^(n-1)), jittered
    rebuild_cap_s: float = 60.0
    drain_grace_s: float = 600.0  # a drain deletes the remaining originals after this long


OWNER = "reconciler"  # the `owner` of the placements this loop manages


@dataclass
class Memory:
    """What the leader remembers between passes (lost on hand-over; rebuilt from etcd)."""

    missing_since: dict[str, float] = field(default_factory=dict)
    rebuild_after: dict[str, float] = field(default_factory=dict)
    rebuilds: Counter[str] = field(default_factory=Counter)
    unplaced: dict[str, Decision] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Put:
    node: str
    replica: str
    doc: dict[str, Any]
    why: str


@dataclass(frozen=True, slots=True)
class Delete:
    node: str
    replica: str
    why: str


Action = Put | Delete


def node_states(
    snap: Snapshot, mem: Memory, now: float, policy: ReconcilerSettings
) -> dict[str, NodeState]:
    names = set(snap.nodes) | {node for node, _ in snap.placements}
    states: dict[str, NodeState] = {}
    for name in names:
        if name in snap.nodes:
            mem.missing_since.pop(name, None)
            states[name] = "ready"
        else:
            since = mem.missing_since.setdefault(name, now)
            states[name] = "lost" if now - since >= policy.lost_after_s else "unreachable"
    for name in list(mem.missing_since):
        if name not in names:
            del mem.missing_since[name]
    return states


def reconcile(
    snap: Snapshot, mem: Memory, now: float, policy: ReconcilerSettings, rand: float = 0.5
) -> list[Action]:
    states = node_states(snap, mem, now, policy)
    actions: list[Action] = []
    gone: set[Key] = set()

    draining = {n for n, c in snap.cordons.items() if c.get("drain")}
    # NOTE: only its own placements; one written by hand is left alone (its devices still count)
    owned = {k: d for k, d in snap.placements.items() if d.get("owner") == OWNER}
    parts = _pipeline_parts(owned)

    def members(key: Key) -> list[Key]:  # every part of its replica (itself if on one node)
        return list(parts.get(key[1], {}).values()) or [key]

    def delete(key: Key, why: str) -> None:  # a multi-node replica goes whole
        for k in members(key):
            if k not in gone:
                gone.add(k)
                actions.append(Delete(k[0], k[1], why if k == key else f"{why} (same replica)"))

    def drains(key: Key) -> bool:
        return any(k[0] in draining for k in members(key))

    for key, doc in sorted(owned.items()):
        model, status = str(doc.get("model", "")), snap.statuses.get(key, {})
        if key in gone:
            continue
        if states[key[0]] == "lost":
            delete(key, f"node {key[0]} lost")
        elif model not in snap.models:
            delete(key, f"model {model} is not in the catalog")
        elif key[1] in parts and len(parts[key[1]]) != pipeline_part(doc)[1]:
            delete(
                key, f"multi-node replica has {len(parts[key[1]])} of {pipeline_part(doc)[1]} parts"
            )
        elif _failed(status, policy):
            delete(key, f"replica failed: {status.get('reason', '')}")
            mem.rebuilds[model] += 1
            mem.rebuild_after[model] = now + _backoff(mem.rebuilds[model], policy, rand)

    live = {k: d for k, d in owned.items() if k not in gone}
    actions += _relay_stages(live, parts, snap)
    # a multi-node replica counts once, as its head (part 0)
    heads = {k: d for k, d in live.items() if pipeline_part(d)[0] == 0}
    # a model's pools: one of role `spec.role` for an aggregated model, a prefill and a decode
    # pool for a disaggregated one; each kept within its own counts
    pools = [(name, spec, role, lo, hi) for name, spec in sorted(snap.models.items())
             for role, lo, hi in spec.wants()]  # fmt: skip
    for _, spec, role, lo, hi in pools:
        mine = {k: d for k, d in heads.items() if spec.in_pool(d, role)}
        serving = {k for k in mine if not drains(k)}
        ready_off_drain = [k for k in serving if _ready(snap.statuses.get(k))]
        for key in sorted(k for k in mine if drains(k)):
            node = next(k[0] for k in members(key) if k[0] in draining)
            cordon = snap.cordons[node]
            grace = float(cordon.get("grace_s", policy.drain_grace_s))
            expired = snap.wall - float(cordon.get("since_unix", snap.wall)) >= grace
            if len(ready_off_drain) >= lo:
                delete(key, f"drained: {len(ready_off_drain)} Ready replica(s) elsewhere")
            elif expired:
                delete(key, "drain grace period over")
        if len(serving) > hi:
            extra = sorted(serving, key=lambda k: (_ready(snap.statuses.get(k)), k))
            delete(extra[0], f"{len(serving)} {_pool(spec, role)}replicas, max {hi}")

    for name, spec, role, lo, _ in pools:
        pool = pool_label(name, spec, role)
        placed = [k for k, d in heads.items() if spec.in_pool(d, role)]
        if sum(k not in gone and not drains(k) for k in placed) >= lo:
            mem.unplaced.pop(pool, None)
            continue
        if now < mem.rebuild_after.get(name, 0.0):
            continue
        sub = spec.for_role(role)
        decision = place(_launchable(sub), views(snap, states, gone))
        if not decision.ok:
            mem.unplaced[pool] = decision
            continue
        mem.unplaced.pop(pool, None)
        actions += placement_for(sub, decision, role)
        break  # one replica per pass, from a fresh snapshot
    return actions


def _pool(spec: ModelSpec, role: str) -> str:
    return f"{role} " if spec.pools else ""


def placement_for(spec: ModelSpec, decision: Decision, role: str | None = None) -> list[Put]:
    """The agents' placement documents for a decision (docs/architecture.md, etcd), for the
    pool of `role` (default: the model's role): one, or one per node of a multi-node
    replica (the same replica id, each with its part; the first node's is the head)."""
    assert decision.profile is not None
    p = spec.profiles[decision.profile]
    profile: dict[str, Any] = {"tensor_parallel": p.tensor_parallel, "kv_connector": p.kv_connector,
                               "launcher": p.launcher, "extra_args": list(p.extra_args),
                               "env": dict(p.env)}  # fmt: skip
    for k in ("ctx", "threads", "dtype", "gpu_memory_utilization", "backend", "url"):
        if getattr(p, k) is not None:
            profile[k] = getattr(p, k)
    replica = f"{spec.name.replace(':', '-')[:48]}-{secrets.token_hex(3)}"
    why = f"profile {decision.profile} ({p.engine} on {p.accelerator})"
    why = f"{why}, {role} pool" if role and spec.pools else why
    head = decision.nodes[0][0]
    puts = []
    for i, (node, devices) in enumerate(decision.nodes):
        doc = {"model": spec.name, "engine": p.engine, "source": p.source or spec.source,
               "devices": list(devices), "role": role or spec.role, "profile": profile,
               "owner": OWNER}  # fmt: skip
        if len(decision.nodes) > 1:
            n = len(decision.nodes)
            doc["pipeline"] = {"part": i, "parts": n, "head": head}
            puts.append(Put(node, replica, doc, f"{why}, {'head' if i == 0 else 'stage'} {i}/{n}"))
        else:
            puts.append(Put(node, replica, doc, why))
    return puts


def explain(spec: ModelSpec, snap: Snapshot, mem: Memory, now: float,
            policy: ReconcilerSettings, role: str | None = None) -> Decision:  # fmt: skip
    """What placing one more replica of `spec` (in its pool of `role`) would decide now, with
    every candidate's reason."""
    sub = spec.for_role(role) if role else spec
    return place(_launchable(sub), views(snap, node_states(snap, mem, now, policy)))


def _launchable(spec: ModelSpec) -> ModelSpec:
    """The profiles agents can launch: one node, or a cgn-infer layer pipeline."""
    profiles = tuple(p for p in spec.profiles if p.nodes == 1 or p.engine == "cgn_infer")
    return replace(spec, profiles=profiles) if profiles != spec.profiles else spec


def _pipeline_parts(owned: Mapping[Key, Mapping[str, Any]]) -> dict[str, dict[int, Key]]:
    """Multi-node replicas: replica id -> part -> its placement's key."""
    out: dict[str, dict[int, Key]] = {}
    for key, doc in owned.items():
        part, parts = pipeline_part(doc)
        if parts > 1:
            out.setdefault(key[1], {})[part] = key
    return out


def _relay_stages(
    live: Mapping[Key, Mapping[str, Any]], parts: Mapping[str, Mapping[int, Key]], snap: Snapshot
) -> list[Action]:
    """Heads whose stages are all Ready at addresses other than the ones their placement
    names get a placement with the new addresses (their agents then start them again)."""
    out: list[Action] = []
    for replica, by_part in sorted(parts.items()):
        if sorted(by_part) != list(range(len(by_part))) or any(
            k not in live for k in by_part.values()
        ):
            continue
        keys = [by_part[i] for i in range(len(by_part))]
        addresses = []
        for key in keys[1:]:
            status = snap.statuses.get(key) or {}
            pipeline = status.get("pipeline")
            address = pipeline.get("address") if isinstance(pipeline, Mapping) else None
            if status.get("phase") != "Ready" or not is_host_port(address):
                break
            addresses.append(str(address))
        else:
            head = keys[0]
            doc = live[head]
            if doc["pipeline"].get("stages") != addresses:
                new = {**doc, "pipeline": {**doc["pipeline"], "stages": addresses}}
                out.append(Put(head[0], replica, new, "stages Ready at " + ", ".join(addresses)))
    return out


def _ready(status: Mapping[str, Any] | None) -> bool:
    return bool(status) and status.get("phase") == "Ready"  # type: ignore[union-attr]


def _failed(status: Mapping[str, Any], policy: ReconcilerSettings) -> bool:
    if status.get("phase") != "Failed":
        return False
    reason = str(status.get("reason", ""))
    return reason.startswith(("refused", "invalid")) or int(status.get("failures", 0)) >= (
        policy.max_local_failures
    )


def _backoff(n: int, policy: ReconcilerSettings, rand: float) -> float:
    ceiling = min(policy.rebuild_cap_s, policy.rebuild_base_s * 2.0 ** max(0, n - 1))
    return ceiling * (1 - 0.5 * rand)
