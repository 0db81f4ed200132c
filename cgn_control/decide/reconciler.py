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
   next placement. A refusal is remembered (`REFUSED_FOR_S`, or until the
   model's profiles change): that engine is not placed on that node again
   meanwhile, and `explain` says why, so a profile a node cannot run is not
   placed and deleted over and over.
4. Drain: placements on a node cordoned with `drain` do not count toward
   the model's replicas, so replacements are placed elsewhere first; an
   original is deleted once the model has `min` Ready replicas off draining
   nodes, or when the drain's grace period is over. (The agent then
   withdraws the endpoint and stops the engine only after its requests in
   flight have finished.)
5. Scale: each pool's target is `min`, or with autoscaling (max > min) what
   cgn_control/decide/scaling.py decided from the load (`scale`); below the target
   (off draining and lost nodes) one placement is made with placement.place();
   above it (or above `max`), one replica is deleted, the one whose loss costs
   least (`removal_cost`): not-Ready ones first, then the slowest (decode speeds
   as the routers learned them, alike within a factor 1.5), then the least load to drain,
   then the least cached prefix the router routes to it, then the node with the
   lowest measured tokens per joule (the agent lets its requests in flight
   finish before it stops the engine).
6. Adapters: a replica that loads its LoRA adapters at start (llama.cpp, vLLM,
   SGLang; cgn-infer its pinned ones) whose set the catalog has since changed
   gets a placement with the new set, and its agent restarts it: one replica
   of a model per pass, while the model's others are Ready.
The reconciler manages only the placements it wrote (`owner: reconciler`);
a placement written by hand is never moved or deleted, though the devices it
holds are not given to anything else.

Multi-node replicas (a cgn-infer layer pipeline, `nodes > 1`): one placement per
node under one replica id, each with its `pipeline` part (0: the head, which
alone counts as the replica and is routed to). Whatever deletes one part
deletes them all (a lost node, a failed part, a drain), so a replica is
rebuilt whole. Once every stage reports Ready with its address, the head's
placement gets the addresses (`pipeline.stages`); its agent starts the head
then, and again whenever a stage comes back elsewhere.
vLLM and SGLang replicas across nodes are ranks (cgn_core/multinode.py): rank 0 starts at
once and reports its rendezvous point; ranks 1..'s placements get it (`pipeline.rendezvous`)
and their agents start them then. Agents do not restart a failed rank: any rank's failure
deletes every rank at once (with the model's rebuild backoff), so the replica is rebuilt
whole. Other engines' multi-node profiles are rejected by placement itself, with the
reason explain shows too.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cgn_control.decide.adapters import adapters_change, adapters_profile, stale_adapters
from cgn_control.decide.catalog import ModelSpec, pool_label
from cgn_control.decide.cluster import Key, Snapshot, node_views
from cgn_control.decide.placement import Decision, NodeState, place
from cgn_control.decide.scaling import Decision as ScaleDecision
from cgn_control.decide.scaling import Pool as ScalePool
from cgn_control.decide.scaling import ReplicaLoad, Sample, Scaler, Signals
from cgn_core import multinode
from cgn_core.multinode import Part
from cgn_core.records import Placement, ReplicaStatus
from cgn_core.settings import ranged


@dataclass(frozen=True, slots=True)
class ReconcilerSettings:
    """The control loop (runs on the elected leader among routers; etcd discovery only)."""

    enabled: bool = True
    # leadership passes to another router this long after the leader dies
    lease_ttl_s: int = ranged(10, 1, 3600)
    interval_s: float = ranged(1.0, 0.01, 3600)  # between passes (each reads a fresh snapshot)
    # a node unreachable this long is lost: its replicas are rebuilt
    lost_after_s: float = ranged(30.0, 0.1, 86400)
    # engine failures in a row on one node before a rebuild elsewhere
    max_local_failures: int = ranged(5, 1, 1000)
    # rebuild backoff: min(cap, base * 2^(n-1)), jittered
    rebuild_base_s: float = ranged(2.0, 0.01, 3600)
    rebuild_cap_s: float = ranged(60.0, 0.01, 86400)
    # a drain deletes the remaining originals after this long
    drain_grace_s: float = ranged(600.0, 0, 604800)
    # The most replicas the autoscaler may want across every model's pools (0: no budget
    # but each pool's max); placement still needs room on a node for each.
    budget_replicas: int = ranged(0, 0, 1 << 20)


OWNER = "reconciler"  # the `owner` of the placements this loop manages


REFUSED_FOR_S = 600.0  # a node's agent refused a model's engine: not placed there again for


@dataclass
class Memory:
    """What the leader remembers between passes (lost on hand-over; rebuilt from etcd)."""

    missing_since: dict[str, float] = field(default_factory=dict)
    rebuild_after: dict[str, float] = field(default_factory=dict)
    rebuilds: Counter[str] = field(default_factory=Counter)
    unplaced: dict[str, Decision] = field(default_factory=dict)
    scaler: Scaler = field(default_factory=Scaler)
    # (model, node, engine) → (the agent's reason, until when, the model's profiles then):
    # not placed there again meanwhile, unless the catalog entry's profiles change
    refused: dict[tuple[str, str, str], tuple[str, float, str]] = field(default_factory=dict)

    def refusals(self, spec: ModelSpec, now: float) -> dict[tuple[str, str], str]:
        """(node, engine) → why, for `spec`'s placements its agents refused lately."""
        out = {}
        for (model, node, engine), (why, until, profiles) in list(self.refused.items()):
            if until <= now or (model == spec.name and profiles != repr(spec.profiles)):
                del self.refused[(model, node, engine)]
            elif model == spec.name:
                left = round(until - now)
                out[(node, engine)] = f"its agent refused it ({why}); not tried again for {left} s"
        return out


@dataclass(frozen=True, slots=True)
class Put:
    node: str
    replica: str
    placement: Placement
    why: str

    @property
    def doc(self) -> dict[str, Any]:
        """The placement document the agent reads (what the leader's loop writes)."""
        return self.placement.to_json()


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
    snap: Snapshot,
    mem: Memory,
    now: float,
    policy: ReconcilerSettings,
    rand: float = 0.5,
    targets: Mapping[str, int] | None = None,
    load: Mapping[str, ReplicaLoad] | None = None,
) -> list[Action]:
    """The actions of one pass. `targets`: replicas per pool label (default: each pool's
    min); `load`: per replica id, the router's view of it (what a removal would cost)."""
    run = _Pass(snap, mem, now, policy, node_states(snap, mem, now, policy))
    run.remove_broken(rand)
    live = {k: d for k, d in run.owned.items() if k not in run.gone}
    run.actions += _relay_stages(live, run.parts, snap)
    run.actions += _refresh_adapters(snap, live)
    # a multi-node replica counts once, as its head (part 0)
    heads = {k: p for k, p in live.items() if p.part.part == 0}
    # a model's pools: one of role `spec.role` for an aggregated model, a prefill and a decode
    # pool for a disaggregated one; each kept within its own counts
    pools = [
        (name, spec, role, lo, hi)
        for name, spec in sorted(snap.models.items())
        for role, lo, hi in spec.wants()
    ]
    targets, load = targets or {}, load or {}
    for name, spec, role, lo, hi in pools:
        cap = min(hi, max(lo, targets.get(pool_label(name, spec, role), lo)))
        mine = {k: d for k, d in heads.items() if spec.in_pool(d, role)}
        run.trim(spec, role, mine, lo, hi, cap, load)
    for name, spec, role, lo, hi in pools:
        want = min(hi, max(lo, targets.get(pool_label(name, spec, role), lo)))
        placed = [k for k, d in heads.items() if spec.in_pool(d, role)]
        if run.place_one(name, spec, role, placed, want):
            break  # one replica per pass, from a fresh snapshot
    return run.actions


@dataclass(slots=True)
class _Pass:
    """One pass of `reconcile`: what it has decided so far (actions, the placements they
    delete) over the snapshot, and the replica arithmetic it needs."""

    snap: Snapshot
    mem: Memory
    now: float
    policy: ReconcilerSettings
    states: dict[str, NodeState]
    actions: list[Action] = field(default_factory=list)
    gone: set[Key] = field(default_factory=set)  # the placements `actions` delete
    draining: set[str] = field(init=False)
    owned: dict[Key, Placement] = field(init=False)
    parts: dict[str, dict[int, Key]] = field(init=False)

    def __post_init__(self) -> None:
        self.draining = {n for n, c in self.snap.cordons.items() if c.drain}
        # NOTE: only its own placements; one written by hand is left alone (its devices
        # still count)
        self.owned = {k: p for k, p in self.snap.placements.items() if p.owner == OWNER}
        self.parts = _pipeline_parts(self.owned)

    def members(self, key: Key) -> list[Key]:
        """Every part of `key`'s replica (itself if on one node)."""
        return list(self.parts.get(key[1], {}).values()) or [key]

    def delete(self, key: Key, why: str) -> None:
        """Delete `key`'s replica, whole (every part of a multi-node one)."""
        for k in self.members(key):
            if k not in self.gone:
                self.gone.add(k)
                self.actions.append(
                    Delete(k[0], k[1], why if k == key else f"{why} (same replica)")
                )

    def drains(self, key: Key) -> bool:
        return any(k[0] in self.draining for k in self.members(key))

    def remove_broken(self, rand: float) -> None:
        """Delete replicas on lost nodes, of models gone from the catalog, missing parts, or
        failed (a failed model's rebuild backs off; a refusal is remembered for that node)."""
        snap, mem = self.snap, self.mem
        for key, p in sorted(self.owned.items()):
            model, status = p.model, snap.statuses.get(key)
            if key in self.gone:
                continue
            if self.states[key[0]] == "lost":
                self.delete(key, f"node {key[0]} lost")
            elif model not in snap.models:
                self.delete(key, f"model {model} is not in the catalog")
            elif key[1] in self.parts and len(self.parts[key[1]]) != p.part.parts:
                have = len(self.parts[key[1]])
                self.delete(key, f"multi-node replica has {have} of {p.part.parts} parts")
            elif status is not None and _failed(
                status, self.policy, p.engine if key[1] in self.parts else ""
            ):
                self.delete(key, f"replica failed: {status.reason}")
                mem.rebuilds[model] += 1
                mem.rebuild_after[model] = self.now + _backoff(
                    mem.rebuilds[model], self.policy, rand
                )
                if status.reason.startswith(("refused", "invalid")):  # the same again, there
                    profiles = repr(snap.models[model].profiles)
                    until = self.now + REFUSED_FOR_S
                    mem.refused[(model, key[0], p.engine)] = (status.reason, until, profiles)

    def trim(
        self,
        spec: ModelSpec,
        role: str,
        mine: Mapping[Key, Placement],
        lo: int,
        hi: int,
        cap: int,
        load: Mapping[str, ReplicaLoad],
    ) -> None:
        """A pool's replicas on draining nodes go once enough are Ready elsewhere (or their
        grace is over); one replica above `cap` goes, the cheapest to remove."""
        snap = self.snap
        serving = {k for k in mine if not self.drains(k)}
        ready_off_drain = [k for k in serving if _ready(snap.statuses.get(k))]
        for key in sorted(k for k in mine if self.drains(k)):
            node = next(k[0] for k in self.members(key) if k[0] in self.draining)
            cordon = snap.cordons[node]
            grace = self.policy.drain_grace_s if cordon.grace_s is None else cordon.grace_s
            since = snap.wall if cordon.since_unix is None else cordon.since_unix
            if len(ready_off_drain) >= lo:
                self.delete(key, f"drained: {len(ready_off_drain)} Ready replica(s) elsewhere")
            elif snap.wall - since >= grace:
                self.delete(key, "drain grace period over")
        if len(serving) > cap:
            extra = sorted(serving, key=lambda k: removal_cost(k, snap, load))
            why = f"max {hi}" if cap == hi else f"the autoscaler's target {cap}"
            self.delete(extra[0], f"{len(serving)} {_pool(spec, role)}replicas, {why}")

    def place_one(
        self, name: str, spec: ModelSpec, role: str, placed: list[Key], want: int
    ) -> bool:
        """Place one replica of a pool short of `want`; whether one was placed."""
        mem, pool = self.mem, pool_label(name, spec, role)
        if sum(k not in self.gone and not self.drains(k) for k in placed) >= want:
            mem.unplaced.pop(pool, None)
            return False
        if self.now < mem.rebuild_after.get(name, 0.0):
            return False
        sub = spec.for_role(role)
        decision = place(
            sub, node_views(self.snap, self.states, self.gone), mem.refusals(spec, self.now)
        )
        if not decision.ok:
            mem.unplaced[pool] = decision
            return False
        mem.unplaced.pop(pool, None)
        self.actions += placement_for(sub, decision, role)
        return True


def scale(
    snap: Snapshot,
    mem: Memory,
    signals: Signals,
    now: float,
    budget: int | None = None,
) -> dict[str, ScaleDecision]:
    """Each pool's autoscaler decision from the router's signals (scaling.py), by pool label.
    `current` counts the pool's replicas placed by this loop and not draining."""
    draining = {n for n, c in snap.cordons.items() if c.drain}
    heads = [
        p
        for (node, _), p in snap.placements.items()
        if p.owner == OWNER and p.part.part == 0 and node not in draining
    ]
    label_of: dict[tuple[str, str], str] = {}
    pools = []
    for name, spec in sorted(snap.models.items()):
        for role, lo, hi in spec.wants():
            label = pool_label(name, spec, role)
            label_of[(name, role if spec.disaggregated else "*")] = label
            current = sum(spec.in_pool(p, role) for p in heads)
            pools.append(
                ScalePool(
                    label,
                    lo,
                    hi,
                    current,
                    spec.scaling,
                    ttft_p90_s=signals.ttft_p90_s.get(name),
                    itl_p90_s=signals.itl_p90_s.get(name),
                    waiting_at_router=signals.waiting_at_router.get(name, 0),
                    shape=signals.shape.get(name),
                )
            )
    samples = [
        Sample(pool, r.replica, r.running, r.waiting, r.ready_for_s, r.speed)
        for r in signals.replicas
        if (pool := label_of.get((r.model, r.role), label_of.get((r.model, "*")))) is not None
    ]
    return mem.scaler.decide(pools, samples, now, budget)


def _pool(spec: ModelSpec, role: str) -> str:
    return f"{role} " if spec.disaggregated else ""


def placement_for(spec: ModelSpec, decision: Decision, role: str | None = None) -> list[Put]:
    """The agents' placement documents for a decision (docs/architecture.md, etcd), for the
    pool of `role` (default: the model's role): one, or one per node of a multi-node
    replica (the same replica id, each with its part; the first node's is the head)."""
    assert decision.profile is not None
    p = spec.profiles[decision.profile]
    profile: dict[str, Any] = {
        "tensor_parallel": p.tensor_parallel,
        "kv_connector": p.kv_connector,
        "launcher": p.launcher,
        "extra_args": list(p.extra_args),
        "env": dict(p.env),
    }
    optional = ("ctx", "threads", "dtype", "gpu_memory_utilization", "backend", "url")
    for k in (*optional, "quantization", "launch_mode", "rendezvous_timeout_s"):
        if getattr(p, k) is not None:
            profile[k] = getattr(p, k)
    profile |= adapters_profile(spec, p.engine, p.backend, p.dtype)
    replica = f"{spec.name.replace(':', '-')[:48]}-{secrets.token_hex(3)}"
    why = f"profile {decision.profile} ({p.engine} on {p.accelerator})"
    why = f"{why}, {role} pool" if role and spec.disaggregated else why
    head = decision.nodes[0][0]
    n = len(decision.nodes)
    puts = []
    for i, (node, devices) in enumerate(decision.nodes):
        one = Placement(
            model=spec.name,
            engine=p.engine,
            source=p.source or spec.source,
            role=role or spec.role,
            devices=tuple(devices),
            owner=OWNER,
            profile=profile,
            part=Part(i, n, head) if n > 1 else Part(),
        )
        where = f", {'head' if i == 0 else 'stage'} {i}/{n}" if n > 1 else ""
        puts.append(Put(node, replica, one, why + where))
    return puts


def explain(
    spec: ModelSpec,
    snap: Snapshot,
    mem: Memory,
    now: float,
    policy: ReconcilerSettings,
    role: str | None = None,
) -> Decision:
    """What placing one more replica of `spec` (in its pool of `role`) would decide now, with
    every candidate's reason."""
    sub = spec.for_role(role) if role else spec
    views = node_views(snap, node_states(snap, mem, now, policy))
    return place(sub, views, mem.refusals(spec, now))


def _refresh_adapters(snap: Snapshot, live: Mapping[Key, Placement]) -> list[Action]:
    """Replicas that load adapters at start whose set is no longer the catalog's, rewritten
    with the new set (their agents restart them): one per model per pass, and only while
    every other replica of the model is Ready, so a model keeps serving through it."""
    out: list[Action] = []
    done: set[str] = set()
    for key, p in sorted(live.items()):
        spec = snap.models.get(p.model)
        if spec is None or p.part.multi or p.model in done:
            continue
        profile = stale_adapters(spec, p)
        others = [k for k, q in live.items() if q.model == p.model and k != key]
        if profile is not None and all(_ready(snap.statuses.get(k)) for k in others):
            done.add(p.model)
            out.append(Put(*key, replace(p, profile=profile), adapters_change(p.profile, profile)))
    return out


def _pipeline_parts(owned: Mapping[Key, Placement]) -> dict[str, dict[int, Key]]:
    """Multi-node replicas: replica id -> part -> its placement's key."""
    out: dict[str, dict[int, Key]] = {}
    for key, p in owned.items():
        if p.part.multi:
            out.setdefault(key[1], {})[p.part.part] = key
    return out


def _relay_stages(
    live: Mapping[Key, Placement], parts: Mapping[str, Mapping[int, Key]], snap: Snapshot
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
        if live[keys[0]].engine in multinode.RANK_ENGINES:
            out += _relay_rendezvous(replica, keys, live, snap)
            continue
        addresses = []
        for key in keys[1:]:
            status = snap.statuses.get(key)
            if status is None or not status.ready or not status.part.address:
                break
            addresses.append(status.part.address)
        else:
            head = keys[0]
            p = live[head]
            if list(p.part.stages) != addresses:
                new = replace(p, part=replace(p.part, stages=tuple(addresses)))
                out.append(Put(head[0], replica, new, "stages Ready at " + ", ".join(addresses)))
    return out


def _relay_rendezvous(
    replica: str, keys: list[Key], live: Mapping[Key, Placement], snap: Snapshot
) -> list[Action]:
    """Ranks 1.. of a vLLM or SGLang replica get rank 0's rendezvous point (its status
    reports it from its start) in their placements; their agents start them then."""
    status = snap.statuses.get(keys[0])
    address = status.part.address if status is not None and status.phase != "Failed" else ""
    out: list[Action] = []
    for key in keys[1:] if address else []:
        p = live[key]
        if p.part.rendezvous != address:
            new = replace(p, part=replace(p.part, rendezvous=address))
            out.append(Put(key[0], replica, new, f"rank 0's rendezvous point is {address}"))
    return out


SPEED_CLASS = 1.5  # replicas whose decode speeds are within this factor are alike to remove


def removal_cost(
    key: Key, snap: Snapshot, load: Mapping[str, ReplicaLoad]
) -> tuple[bool, int, float, int, float, Key]:
    """What removing the replica at `key` would cost, least first: Ready (a replica still
    loading serves nothing), its speed (the slowest goes first: its loss costs the fleet
    least; speeds within SPEED_CLASS of each other alike, one not learned as the fastest),
    the requests it would have to drain (this router's in flight plus the engine's running
    and waiting), the KV blocks the router routes to it (prefix hits lost), its node's
    tokens per joule (the less efficient goes; unmeasured last), then the key (a stable
    order)."""
    seen = load.get(key[1])
    work = seen.in_flight + seen.running + seen.waiting if seen is not None else 0.0
    cached = seen.cached_blocks if seen is not None else 0
    speed = seen.speed if seen is not None else None
    fastness = 1 << 30  # not learned: as the fastest
    if speed is not None and speed.usable:
        fastness = -round(math.log(speed.decode_s) / math.log(SPEED_CLASS))
    eff = snap.efficiency.get(key[0])
    tpj = eff.fresh(snap.wall) if eff is not None else None
    per_joule = math.inf if tpj is None else tpj
    return _ready(snap.statuses.get(key)), fastness, work, cached, per_joule, key


def _ready(status: ReplicaStatus | None) -> bool:
    return status is not None and status.ready


def _failed(status: ReplicaStatus, policy: ReconcilerSettings, multi_engine: str = "") -> bool:
    """Whether a placement's failure calls for a rebuild: a refusal, too many failures in a
    row on its node, or any failure of one rank of a multi-node vLLM or SGLang replica (its
    agent does not restart it: the ranks' process group is rebuilt whole)."""
    if status.phase != "Failed":
        return False
    return (
        status.reason.startswith(("refused", "invalid"))
        or status.failures >= policy.max_local_failures
        or multi_engine in multinode.RANK_ENGINES
    )


def _backoff(n: int, policy: ReconcilerSettings, rand: float) -> float:
    ceiling = min(policy.rebuild_cap_s, policy.rebuild_base_s * 2.0 ** max(0, n - 1))
    return ceiling * (1 - 0.5 * rand)
