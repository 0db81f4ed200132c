"""Plain values of the etcd client: keys, events, transaction compares and operations."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from cgn_proto.etcd import kv_pb2, rpc_pb2


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix` (etcd's range_end)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"  # every key


def json_value(doc: Any) -> bytes:
    """How a JSON record is stored: compact, keys sorted (so equal documents are equal bytes,
    and a writer can tell an unchanged record without a write)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        """The value decoded as JSON (Cognitora stores JSON values, docs/architecture.md, etcd)."""
        return json.loads(self.value)

    @classmethod
    def from_pb(cls, kv: kv_pb2.KeyValue) -> KeyValue:
        return cls(
            key=kv.key.decode("utf-8", "surrogateescape"),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue  # for a delete: the key, an empty value and the deletion's revision


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """What one watch step delivers.

    Either `events` (in revision order, each revision delivered exactly once),
    or, after the watched revision was compacted away, `resync`: the full
    current contents of the prefix as of `revision`, which replaces whatever
    the consumer held.
    """

    revision: int
    events: tuple[WatchEvent, ...] = ()
    resync: tuple[KeyValue, ...] | None = None


_CMP_OPS = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    ">": rpc_pb2.Compare.GREATER,
    "<": rpc_pb2.Compare.LESS,
}


_CMP_TARGETS = {
    "version": rpc_pb2.Compare.VERSION,
    "create_revision": rpc_pb2.Compare.CREATE,
    "mod_revision": rpc_pb2.Compare.MOD,
    "value": rpc_pb2.Compare.VALUE,
    "lease": rpc_pb2.Compare.LEASE,
}


def _key(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction, e.g. `Compare.create_revision(k, "==", 0)` (absent)."""

    key: str
    target: Literal["value", "version", "create_revision", "mod_revision", "lease"]
    op: Literal["==", "!=", ">", "<"]
    operand: bytes | int

    @classmethod
    def value(cls, key: str, op: Literal["==", "!=", ">", "<"], value: bytes) -> Compare:
        return cls(key, "value", op, value)

    @classmethod
    def version(cls, key: str, op: Literal["==", "!=", ">", "<"], n: int) -> Compare:
        return cls(key, "version", op, n)

    @classmethod
    def create_revision(cls, key: str, op: Literal["==", "!=", ">", "<"], n: int) -> Compare:
        return cls(key, "create_revision", op, n)

    @classmethod
    def mod_revision(cls, key: str, op: Literal["==", "!=", ">", "<"], n: int) -> Compare:
        return cls(key, "mod_revision", op, n)

    def to_pb(self) -> rpc_pb2.Compare:
        target = _CMP_TARGETS[self.target]
        return rpc_pb2.Compare(
            key=_key(self.key),
            result=_CMP_OPS[self.op],
            target=target,
            **{self.target: self.operand},
        )


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of a transaction branch."""

    kind: Literal["put", "delete", "get"]
    key: str
    value: bytes = b""
    lease: int = 0
    prefix: bool = False

    @classmethod
    def put(cls, key: str, value: bytes, lease: int = 0) -> Op:
        return cls("put", key, value, lease)

    @classmethod
    def put_json(cls, key: str, doc: Any, lease: int = 0) -> Op:
        return cls("put", key, json_value(doc), lease)

    @classmethod
    def delete(cls, key: str, *, prefix: bool = False) -> Op:
        return cls("delete", key, prefix=prefix)

    @classmethod
    def get(cls, key: str, *, prefix: bool = False) -> Op:
        return cls("get", key, prefix=prefix)

    def to_pb(self) -> rpc_pb2.RequestOp:
        key = _key(self.key)
        end = prefix_end(key) if self.prefix else b""
        if self.kind == "put":
            return rpc_pb2.RequestOp(
                request_put=rpc_pb2.PutRequest(key=key, value=self.value, lease=self.lease)
            )
        if self.kind == "delete":
            return rpc_pb2.RequestOp(
                request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=end)
            )
        return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key, range_end=end))


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # For every `get` op of the branch that ran, the key-values it read.
    gets: tuple[tuple[KeyValue, ...], ...] = ()
