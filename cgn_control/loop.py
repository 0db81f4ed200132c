"""The reconciler's I/O shell: leader election among routers, snapshots in, placements out.

Every router campaigns for `/cognitora/leader/reconciler`; only the leader
runs passes. A pass reads a fresh snapshot (catalog, nodes, placements,
replica statuses, cordons) and the load its router sees (`signals`), asks
the autoscaler for each pool's target (reconciler.scale), calls
reconciler.reconcile with those targets, and writes each action in a
transaction that holds only while this router still leads, so a deposed
leader can never write. A changed target is recorded under
`/cognitora/scaling/<pool>` with its reason and the last decisions (for
`cgn-ctl explain-scaling`). Losing the lease (or etcd) ends leadership;
the router campaigns again and another may take over meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cgn_control.cluster_reader import read_snapshot
from cgn_control.decide.catalog import pool_label, pool_record
from cgn_control.decide.reconciler import Memory, Put, ReconcilerSettings, reconcile, scale
from cgn_control.decide.scaling import Decision as ScaleDecision
from cgn_control.decide.scaling import Signals
from cgn_core import keys
from cgn_core.backoff import Backoff
from cgn_core.errors import CognitoraError
from cgn_core.etcd import Compare, Election, EtcdClient, Op
from cgn_core.records import SCALING_HISTORY, RecordLog

log = logging.getLogger(__name__)
ELECTION = keys.RECONCILER_ELECTION


@dataclass
class ControlState:
    """What the admin listener shows of the control loop (/reconciler)."""

    candidate: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{random.getrandbits(32):08x}"
    )
    leading: bool = False
    passes: int = 0
    last_pass_unix: float = 0.0
    unplaced: dict[str, list[str]] = field(default_factory=dict)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    scaling: dict[str, dict[str, Any]] = field(default_factory=dict)  # pool -> last decision
    history: dict[str, deque[dict[str, Any]]] = field(default_factory=dict)  # pool -> changes
    written: dict[str, dict[str, Any]] = field(default_factory=dict)  # pool -> last in etcd
    changes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (pool, up|down)

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "leading": self.leading,
            "passes": self.passes,
            "last_pass_unix": self.last_pass_unix,
            "unplaced": self.unplaced,
            "recent_actions": list(self.recent),
            "scaling": self.scaling,
        }


async def run_reconciler(
    client: EtcdClient,
    settings: ReconcilerSettings,
    state: ControlState,
    signals: Callable[[], Signals] | None = None,
) -> None:
    """Campaign, lead, pass, forever (cancel to stop). `signals`: the load the router running
    this loop sees (None: none, every pool stays at its min)."""
    backoff = Backoff(base=0.5, cap=5.0)
    records = RecordLog(log)  # each bad record is reported once, not on every pass
    while True:
        election = Election(client, ELECTION, state.candidate, settings.lease_ttl_s)
        try:
            await election.campaign()
            log.info("reconciler: leading as %s", state.candidate)
            state.leading = True
            memory = Memory()
            while election.leading:
                await _pass(client, election, settings, state, memory, records, signals)
                backoff.reset()
                await asyncio.sleep(settings.interval_s)
            log.warning("reconciler: leadership lost")
        except CognitoraError as exc:
            delay = backoff.next()
            log.warning("reconciler: %s; campaigning again in %.1fs", exc.message, delay)
            await asyncio.sleep(delay)
        except Exception:  # NOTE: top of the control loop: a bug must not end the router
            delay = backoff.next()
            log.exception("reconciler: pass failed; campaigning again in %.1fs", delay)
            await asyncio.sleep(delay)
        finally:
            state.leading = False
            await asyncio.shield(election.resign())


async def _pass(
    client: EtcdClient,
    election: Election,
    settings: ReconcilerSettings,
    state: ControlState,
    memory: Memory,
    records: RecordLog,
    signals: Callable[[], Signals] | None = None,
) -> None:
    snap = await read_snapshot(client, records)
    now = time.monotonic()
    seen = signals() if signals is not None else Signals()
    decisions = scale(snap, memory, seen, now, settings.budget_replicas or None)
    targets = {label: d.desired for label, d in decisions.items()}
    load = {r.replica: r for r in seen.replicas}
    actions = reconcile(snap, memory, now, settings, random.random(), targets, load)
    lead = [Compare.value(election.key, "==", state.candidate.encode())]
    names = {
        pool_label(name, spec, role): (
            name,
            role if spec.disaggregated else "",
            pool_record(name, spec, role),
        )
        for name, spec in snap.models.items()
        for role, _, _ in spec.wants()
    }
    if not await _record_scaling(client, lead, state, decisions, names):
        return
    for a in actions:
        key = f"{keys.PLACEMENTS}{a.node}/{a.replica}"
        op = Op.put_json(key, a.doc) if isinstance(a, Put) else Op.delete(key)
        res = await client.txn(lead, [op])
        if not res.succeeded:
            log.warning("reconciler: no longer the leader; %s not written", key)
            return
        kind = "place" if isinstance(a, Put) else "delete"
        log.info("reconciler: %s %s/%s: %s", kind, a.node, a.replica, a.why)
        state.recent.append(
            {
                "at_unix": time.time(),
                "action": kind,
                "node": a.node,
                "replica": a.replica,
                "why": a.why,
            }
        )
    state.unplaced = {m: d.explain() for m, d in memory.unplaced.items()}
    state.passes += 1
    state.last_pass_unix = time.time()


REFRESH_S = 10.0  # a pool's record is rewritten for a new reason at most this often


async def _record_scaling(
    client: EtcdClient,
    lead: list[Compare],
    state: ControlState,
    decisions: dict[str, ScaleDecision],
    names: dict[str, tuple[str, str, str]],  # pool label -> (model, role, its record's name)
) -> bool:
    """Show every pool's decision (/reconciler, each pass); write a pool's record when its
    target changed, or its reason every REFRESH_S. False when this router no longer leads."""
    now = time.time()
    for label, d in decisions.items():
        model, role, record_name = names[label]
        doc = {"model": model, "role": role, **d.to_json(), "at_unix": round(now, 3)}
        state.scaling[label] = doc
        last = state.written.get(label)
        if (
            last is not None
            and last["desired"] == d.desired
            and (last["reason"] == d.reason or now - last["at_unix"] < REFRESH_S)
        ):
            continue
        state.written[label] = doc
        history = state.history.setdefault(label, deque(maxlen=SCALING_HISTORY))
        if d.direction != "hold" or not history:
            history.append(doc)
        record = {**doc, "history": list(history)}
        key = keys.SCALING + record_name
        res = await client.txn(lead, [Op.put_json(key, record)])
        if not res.succeeded:
            log.warning("reconciler: no longer the leader; scaling of %s not written", label)
            return False
        if d.direction != "hold":
            state.changes[(label, d.direction)] += 1
            log.info("autoscaler: %s %d -> %d: %s", label, d.current, d.desired, d.reason)
    for gone in set(state.scaling) - set(decisions):
        del state.scaling[gone]
        state.history.pop(gone, None)
        state.written.pop(gone, None)
    return True
