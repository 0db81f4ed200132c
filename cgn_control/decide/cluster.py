"""The cluster as etcd describes it at one moment, read in one place for every reader.

`read_snapshot` (cluster_reader.py) lists the catalog, nodes, placements, replica statuses,
cordons and efficiencies, each record parsed into its typed value (`cgn_core.records`);
`views` turns a snapshot into placement's NodeViews (devices and replicas already placed
count as used). The router's reconciler and `cgn-ctl` (nodes, replicas, explain-placement,
status) both read through here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from cgn_control.decide.catalog import ModelSpec
from cgn_control.decide.placement import NodeState, NodeView, node_view
from cgn_core import records
from cgn_core.records import Cordon, Efficiency, NodeInventory, Placement, ReplicaStatus, Scaling

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (node, replica)
EMPTY_NODE = NodeInventory()


@dataclass(frozen=True, slots=True)
class Snapshot:
    models: Mapping[str, ModelSpec]
    nodes: Mapping[str, NodeInventory]  # registered nodes
    placements: Mapping[Key, Placement]
    statuses: Mapping[Key, ReplicaStatus]
    cordons: Mapping[str, Cordon]
    wall: float = 0.0  # time.time() when the snapshot was read (cordon times are wall-clock)
    efficiency: Mapping[str, Efficiency] = field(default_factory=dict)  # cgn-metrics'
    scaling: Mapping[str, Scaling] = field(default_factory=dict)  # by pool_record; the leader's

    @classmethod
    def of(
        cls,
        models: Mapping[str, ModelSpec],
        nodes: Mapping[str, Any] | None = None,
        placements: Mapping[Key, Any] | None = None,
        statuses: Mapping[Key, Any] | None = None,
        cordons: Mapping[str, Any] | None = None,
        wall: float = 0.0,
        efficiency: Mapping[str, Any] | None = None,
        scaling: Mapping[str, Any] | None = None,
    ) -> Snapshot:
        """A snapshot from JSON documents, each through its record's parser (as etcd's are
        read); a bad one raises RecordError. For tools and tests that build a cluster."""
        return cls(
            models,
            {n: records.node_inventory(d) for n, d in (nodes or {}).items()},
            {k: records.placement(d) for k, d in (placements or {}).items()},
            {k: records.replica_status(d) for k, d in (statuses or {}).items()},
            {n: records.cordon(d) for n, d in (cordons or {}).items()},
            wall,
            {n: records.efficiency(d) for n, d in (efficiency or {}).items()},
            {p: records.scaling(d) for p, d in (scaling or {}).items()},
        )


def node_views(
    snap: Snapshot, states: Mapping[str, NodeState], gone: Collection[Key] = ()
) -> list[NodeView]:
    """Every known node as placement sees it, with the devices and replicas already placed."""
    used: dict[str, set[int]] = {}
    counts: dict[str, Counter[str]] = {}
    for key, p in snap.placements.items():
        if key in gone:
            continue
        used.setdefault(key[0], set()).update(p.devices)
        counts.setdefault(key[0], Counter())[p.model] += 1
    out = []
    for name, state in sorted(states.items()):
        held = frozenset(used.get(name, ()))
        tpj = records.fresh_efficiency(snap.efficiency.get(name), snap.wall)
        out.append(
            node_view(
                name,
                snap.nodes.get(name, EMPTY_NODE),
                cordoned=name in snap.cordons,
                state=state,
                used=held,
                replicas=counts.get(name),
                tokens_per_joule=tpj,
            )
        )
    return out
