"""The cluster as etcd describes it at one moment, read in one place for every reader.

`read_snapshot` lists the catalog, nodes, placements, replica statuses and
cordons; `views` turns a snapshot into placement's NodeViews (devices and
replicas already placed count as used). The router's reconciler and
`cgn-ctl` (nodes, replicas, explain-placement, status) both read through here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from cgn_control.catalog import ModelSpec
from cgn_control.placement import NodeState, NodeView, node_view
from cgn_core.records import fresh_efficiency

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (node, replica)


@dataclass(frozen=True, slots=True)
class Snapshot:
    models: Mapping[str, ModelSpec]
    nodes: Mapping[str, Mapping[str, Any]]  # registered nodes' inventory documents
    placements: Mapping[Key, Mapping[str, Any]]
    statuses: Mapping[Key, Mapping[str, Any]]
    cordons: Mapping[str, Mapping[str, Any]]  # node -> {"drain": bool, "since_unix", "grace_s"}
    wall: float = 0.0  # time.time() when the snapshot was read (cordon times are wall-clock)
    efficiency: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # cgn-metrics'


def views(
    snap: Snapshot, states: Mapping[str, NodeState], gone: Collection[Key] = ()
) -> list[NodeView]:
    """Every known node as placement sees it, with the devices and replicas already placed."""
    used: dict[str, set[int]] = {}
    counts: dict[str, Counter[str]] = {}
    for key, doc in snap.placements.items():
        if key in gone:
            continue
        used.setdefault(key[0], set()).update(int(d) for d in doc.get("devices", []))
        counts.setdefault(key[0], Counter())[str(doc.get("model", ""))] += 1
    out = []
    for name, state in sorted(states.items()):
        inv = snap.nodes.get(name, {})
        held = frozenset(used.get(name, ()))
        tpj = fresh_efficiency(snap.efficiency.get(name), snap.wall)
        view = node_view(name, inv, cordoned=name in snap.cordons, state=state, used=held,
                         replicas=counts.get(name), tokens_per_joule=tpj)  # fmt: skip
        out.append(view)
    return out
