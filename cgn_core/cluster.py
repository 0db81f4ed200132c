"""The cluster as etcd describes it at one moment, read in one place for every reader.

`read_snapshot` lists the catalog, nodes, placements, replica statuses and
cordons; `views` turns a snapshot into placement's NodeViews (devices and
replicas already placed count as used). The router's reconciler and
`cgn-ctl` (nodes, replicas, explain-placement, status) both read through here.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from cgn_core import keys
from cgn_core import records as records_
from cgn_core.catalog import ModelSpec, parse_model
from cgn_core.etcd.client import EtcdClient
from cgn_core.etcd.types import KeyValue
from cgn_core.placement import NodeState, NodeView, node_view
from cgn_core.records import RecordLog

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
        view = node_view(name, inv, cordoned=name in snap.cordons, state=state, used=held,
                         replicas=counts.get(name))  # fmt: skip
        out.append(view)
    return out


async def read_snapshot(client: EtcdClient, records: RecordLog | None = None) -> Snapshot:
    """Catalog, nodes, placements, statuses and cordons as of one moment (each a fresh list).

    Every record is validated (`cgn_core.records`); a bad one is left out of the snapshot and
    reported through `records` once per revision (pass the same RecordLog on every pass)."""
    rec = records or RecordLog(log)
    catalog, _ = await client.get_prefix(keys.CATALOG)
    nodes, _ = await client.get_prefix(keys.NODES)
    placements, _ = await client.get_prefix(keys.PLACEMENTS)
    statuses, _ = await client.get_prefix(keys.REPLICAS)
    cordons, _ = await client.get_prefix(keys.CORDON)
    models: dict[str, ModelSpec] = {}
    for kv in catalog:
        name = kv.key[len(keys.CATALOG) :]
        spec = rec.parse(
            kv.key, kv.mod_revision, kv.value, functools.partial(parse_model, where=name)
        )
        if spec is not None:
            models[name] = spec
    return Snapshot(
        models=models,
        nodes=_by_name(rec, nodes, keys.NODES, records_.node_inventory),
        placements=_by_replica(rec, placements, keys.PLACEMENTS, records_.placement),
        statuses=_by_replica(rec, statuses, keys.REPLICAS, records_.replica_status),
        cordons=_by_name(rec, cordons, keys.CORDON, records_.cordon),
        wall=time.time(),
    )


Parse = Callable[[Any], dict[str, Any]]


def _by_name(rec: RecordLog, kvs: list[KeyValue], prefix: str, parse: Parse) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {}
    for kv in kvs:
        doc = rec.parse(kv.key, kv.mod_revision, kv.value, parse)
        if doc is not None:
            out[kv.key[len(prefix) :]] = doc
    return out


def _by_replica(
    rec: RecordLog, kvs: list[KeyValue], prefix: str, parse: Parse
) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for kv in kvs:
        node, _, replica = kv.key[len(prefix) :].partition("/")
        if not node or not replica:
            continue
        doc = rec.parse(kv.key, kv.mod_revision, kv.value, parse)
        if doc is not None:
            out[(node, replica)] = doc
    return out
