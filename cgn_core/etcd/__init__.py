"""Cognitora's asyncio etcd v3 client (grpc.aio over etcd's own protos)."""

from cgn_core.etcd.client import EtcdClient, EtcdError, LeaseNotFound
from cgn_core.etcd.election import Election
from cgn_core.etcd.lease import Lease
from cgn_core.etcd.types import Compare, KeyValue, Op, TxnResult, WatchBatch, WatchEvent

__all__ = [
    "Compare",
    "Election",
    "EtcdClient",
    "EtcdError",
    "KeyValue",
    "Lease",
    "LeaseNotFound",
    "Op",
    "TxnResult",
    "WatchBatch",
    "WatchEvent",
]
