"""The cluster as of one moment, read from etcd and validated
(`cgn_control.decide.cluster.Snapshot`).

Apart from `cgn_control.decide.cluster` so that the decisions built on a snapshot (the
reconciler, placement) import no etcd client.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from cgn_control.decide.catalog import ModelSpec, parse_model
from cgn_control.decide.cluster import Key, Snapshot
from cgn_core import keys
from cgn_core import records as records_
from cgn_core.etcd.client import EtcdClient
from cgn_core.etcd.types import KeyValue
from cgn_core.records import RecordLog

log = logging.getLogger(__name__)
T = TypeVar("T")


async def read_snapshot(client: EtcdClient, records: RecordLog | None = None) -> Snapshot:
    """Catalog, nodes, placements, statuses, cordons, measured node efficiencies and the
    autoscaler's last decisions as of one moment (each a fresh list).

    Every record is validated (`cgn_core.records`); a bad one is left out of the snapshot and
    reported through `records` once per revision (pass the same RecordLog on every pass)."""
    rec = records or RecordLog(log)
    catalog, _ = await client.get_prefix(keys.CATALOG)
    nodes, _ = await client.get_prefix(keys.NODES)
    placements, _ = await client.get_prefix(keys.PLACEMENTS)
    statuses, _ = await client.get_prefix(keys.REPLICAS)
    cordons, _ = await client.get_prefix(keys.CORDON)
    efficiency, _ = await client.get_prefix(keys.EFFICIENCY)
    scaling, _ = await client.get_prefix(keys.SCALING)
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
        efficiency=_by_name(rec, efficiency, keys.EFFICIENCY, records_.efficiency),
        scaling=_by_name(rec, scaling, keys.SCALING, records_.scaling),
    )


def _by_name(
    rec: RecordLog, kvs: list[KeyValue], prefix: str, parse: Callable[[Any], T]
) -> dict[str, T]:
    out: dict[str, T] = {}
    for kv in kvs:
        value = rec.parse(kv.key, kv.mod_revision, kv.value, parse)
        if value is not None:
            out[kv.key[len(prefix) :]] = value
    return out


def _by_replica(
    rec: RecordLog, kvs: list[KeyValue], prefix: str, parse: Callable[[Any], T]
) -> dict[Key, T]:
    out: dict[Key, T] = {}
    for kv in kvs:
        node, _, replica = kv.key[len(prefix) :].partition("/")
        if not node or not replica:
            continue
        value = rec.parse(kv.key, kv.mod_revision, kv.value, parse)
        if value is not None:
            out[(node, replica)] = value
    return out
