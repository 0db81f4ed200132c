"""What people and status fields read of a snapshot: node states, a model's replicas (pure).

`cgn-ctl` (nodes, models, status) and cgn-operator (a CognitoraModel's status) count
the same way: a multi-node replica counts once, as its head (the part routers see).
"""

from __future__ import annotations

from dataclasses import dataclass

from cgn_control.decide.cluster import Snapshot
from cgn_control.decide.placement import NodeState


def node_states(snap: Snapshot) -> dict[str, NodeState]:
    """Without the reconciler's memory of when a node vanished: registered, or unreachable."""
    names = set(snap.nodes) | {n for n, _ in snap.placements}
    return {n: "ready" if n in snap.nodes else "unreachable" for n in names}


@dataclass(frozen=True, slots=True)
class ModelReplicas:
    placed: int  # replicas placed (heads of multi-node ones)
    ready: int  # of those, Ready
    failed: int  # of those, Failed
    reasons: tuple[str, ...]  # the failed ones' reasons, as the agents reported them


def model_replicas(snap: Snapshot, name: str) -> ModelReplicas:
    mine = [k for k, p in snap.placements.items() if p.model == name and p.part.part == 0]
    statuses = [st for k in mine if (st := snap.statuses.get(k)) is not None]
    failed = [st for st in statuses if st.phase == "Failed"]
    return ModelReplicas(
        placed=len(mine),
        ready=sum(st.ready for st in statuses),
        failed=len(failed),
        reasons=tuple(st.reason for st in failed if st.reason),
    )
