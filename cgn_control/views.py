"""What people and status fields read of a snapshot: node states, a model's replicas (pure).

`cgn-ctl` (nodes, models, status) and cgn-operator (a CognitoraModel's status) count
the same way: a multi-node replica counts once, as its head (the part routers see).
"""

from __future__ import annotations

from dataclasses import dataclass

from cgn_control.cluster import Snapshot
from cgn_control.placement import NodeState
from cgn_core.records import pipeline_part


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
    mine = [k for k, d in snap.placements.items()
            if d.get("model") == name and pipeline_part(d)[0] == 0]  # fmt: skip
    phases = [snap.statuses.get(k, {}) for k in mine]
    failed = [st for st in phases if st.get("phase") == "Failed"]
    return ModelReplicas(
        placed=len(mine),
        ready=sum(st.get("phase") == "Ready" for st in phases),
        failed=len(failed),
        reasons=tuple(str(st.get("reason", "")) for st in failed if st.get("reason")),
    )
