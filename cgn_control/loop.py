"""The reconciler's I/O shell: leader election among routers, snapshots in, placements out.

Every router campaigns for `/cognitora/leader/reconciler`; only the leader
runs passes. A pass reads a fresh snapshot (catalog, nodes, placements,
replica statuses, cordons), calls reconciler.reconcile, and writes each
action in a transaction that holds only while this router still leads, so a
deposed leader can never write. Losing the lease (or etcd) ends leadership;
the router campaigns again and another may take over meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cgn_control.cluster_reader import read_snapshot
from cgn_control.reconciler import Memory, Put, ReconcilerSettings, reconcile
from cgn_core import keys
from cgn_core.backoff import Backoff
from cgn_core.errors import CognitoraError
from cgn_core.etcd import Compare, Election, EtcdClient, Op
from cgn_core.records import RecordLog

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

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "leading": self.leading,
            "passes": self.passes,
            "last_pass_unix": self.last_pass_unix,
            "unplaced": self.unplaced,
            "recent_actions": list(self.recent),
        }


async def run_reconciler(
    client: EtcdClient, settings: ReconcilerSettings, state: ControlState
) -> None:
    """Campaign, lead, pass, forever (cancel to stop)."""
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
                await _pass(client, election, settings, state, memory, records)
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
) -> None:
    snap = await read_snapshot(client, records)
    actions = reconcile(snap, memory, time.monotonic(), settings, random.random())
    lead = [Compare.value(election.key, "==", state.candidate.encode())]
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
