"""An asyncio etcd v3 client over stubs generated from etcd's protos (`grpc.aio`).

Every unary call carries a deadline (`EtcdSettings.timeout_s`) and fails with
`EtcdUnavailable`, naming the endpoints tried, when etcd cannot be reached:
never a hang. With several endpoints, a call that finds one unavailable tries
the next before giving up. A one-shot caller (cgn-ctl) passes `patient=True`: a
round of unavailable endpoints is tried again, with backoff, until `timeout_s`
has passed since the call began, so a loaded etcd that is slow to accept one
connection is not reported as down; daemons keep failing fast and retry in
their own loops. Streams (watches, lease keep-alives) live in
`watch.py` and `lease.py` and reconnect on their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from cgn_core.errors import EtcdUnavailable, PermanentError
from cgn_core.etcd.types import (
    Compare,
    KeyValue,
    Op,
    TxnResult,
    WatchBatch,
    json_value,
    prefix_end,
)
from cgn_core.etcd.watch import watch_prefix
from cgn_core.settings import EtcdSettings
from cgn_core.tls import channel_credentials, warn_if_plaintext
from cgn_proto.etcd import rpc_pb2, rpc_pb2_grpc

log = logging.getLogger(__name__)
R = TypeVar("R")

# Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s),
# and detect dead connections; etcd refuses pings more often than every 5 s.
# Not `grpc.min_reconnect_backoff_ms`: gRPC takes it as the time a connection
# attempt may take (default 20 s), and at 100 ms a loaded etcd, or one a TLS
# handshake away over a slow link, was reported unreachable.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class EtcdError(PermanentError):
    """etcd refused a request (not a connectivity problem)."""


class LeaseNotFound(EtcdError):
    """The lease expired or was revoked."""


def _encode(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


class EtcdClient:
    """Key-value, transaction, lease and watch access to one etcd cluster."""

    def __init__(self, settings: EtcdSettings, *, patient: bool = False):
        if not settings.endpoints:
            raise EtcdError("no etcd endpoints configured")
        self.settings = settings
        self.patient = patient
        self._channels: list[grpc.aio.Channel | None] = [None] * len(settings.endpoints)
        self._current = 0
        if not settings.tls.enabled:
            warn_if_plaintext(log, "etcd client", settings.tls)

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for i, ch in enumerate(self._channels):
            if ch is not None:
                await ch.close()
                self._channels[i] = None

    # ---- channels and calls ------------------------------------------------

    def channel(self, index: int | None = None) -> grpc.aio.Channel:
        """The gRPC channel to endpoint `index` (default: the one last seen working)."""
        i = self._current if index is None else index
        ch = self._channels[i]
        if ch is None:
            target = self.settings.endpoints[i]
            if self.settings.tls.enabled:
                creds = channel_credentials(self.settings.tls)
                ch = grpc.aio.secure_channel(target, creds, options=_CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
            self._channels[i] = ch
        return ch

    def rotate(self) -> None:
        """Move to the next endpoint (after the current one failed)."""
        self._current = (self._current + 1) % len(self.settings.endpoints)

    async def call(self, fn: Callable[[grpc.aio.Channel], Awaitable[R]]) -> R:
        """Run one unary RPC with failover across endpoints and a clear error when all fail."""
        deadline = time.monotonic() + self.settings.timeout_s
        pause = 0.1
        while True:
            failures: list[str] = []
            for _ in self.settings.endpoints:
                try:
                    return await fn(self.channel())
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in _UNAVAILABLE:
                        raise _permanent(exc) from None
                    failures.append(f"{self.settings.endpoints[self._current]}: {_describe(exc)}")
                    self.rotate()
            if not self.patient or time.monotonic() + pause >= deadline:
                raise EtcdUnavailable(f"etcd unreachable ({'; '.join(failures)})")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _kv(self, ch: grpc.aio.Channel) -> rpc_pb2_grpc.KVStub:
        return rpc_pb2_grpc.KVStub(ch)

    # ---- key-value -----------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        kvs, _ = await self._range(rpc_pb2.RangeRequest(key=_encode(key)))
        return kvs[0] if kvs else None

    async def get_json(self, key: str) -> Any:
        kv = await self.get(key)
        return None if kv is None else kv.json()

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, sorted by key, and the store revision they are current to."""
        key = _encode(prefix)
        return await self._range(rpc_pb2.RangeRequest(key=key, range_end=prefix_end(key)))

    async def revision(self) -> int:
        """The store's current revision."""
        _, rev = await self._range(rpc_pb2.RangeRequest(key=b"\0", count_only=True))
        return rev

    async def _range(self, req: rpc_pb2.RangeRequest) -> tuple[list[KeyValue], int]:
        resp = await self.call(lambda ch: self._kv(ch).Range(req, timeout=self.settings.timeout_s))
        return [KeyValue.from_pb(kv) for kv in resp.kvs], resp.header.revision

    async def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Write `key`; returns the new revision. `lease` ties the key's life to a lease."""
        data = value.encode() if isinstance(value, str) else value
        req = rpc_pb2.PutRequest(key=_encode(key), value=data, lease=lease)
        resp = await self.call(lambda ch: self._kv(ch).Put(req, timeout=self.settings.timeout_s))
        return int(resp.header.revision)

    async def put_json(self, key: str, obj: Any, lease: int = 0) -> int:
        return await self.put(key, json_value(obj), lease)

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete `key` (or every key under it with `prefix=True`); returns how many went."""
        k = _encode(key)
        req = rpc_pb2.DeleteRangeRequest(key=k, range_end=prefix_end(k) if prefix else b"")
        resp = await self.call(
            lambda ch: self._kv(ch).DeleteRange(req, timeout=self.settings.timeout_s)
        )
        return int(resp.deleted)

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """If every compare holds, run `success`, otherwise `failure`; atomically."""
        req = rpc_pb2.TxnRequest(
            compare=[c.to_pb() for c in compare],
            success=[o.to_pb() for o in success],
            failure=[o.to_pb() for o in failure],
        )
        resp = await self.call(lambda ch: self._kv(ch).Txn(req, timeout=self.settings.timeout_s))
        gets = tuple(
            tuple(KeyValue.from_pb(kv) for kv in r.response_range.kvs)
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        )
        return TxnResult(resp.succeeded, resp.header.revision, gets)

    async def put_if_absent(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Create `key` only if it does not exist; True if this call created it."""
        res = await self.txn([Compare.create_revision(key, "==", 0)], [Op.put(key, value, lease)])
        return res.succeeded

    async def compare_and_swap(self, key: str, value: bytes, mod_revision: int) -> bool:
        """Write `key` only if it is still at `mod_revision` (0: only if absent)."""
        res = await self.txn([Compare.mod_revision(key, "==", mod_revision)], [Op.put(key, value)])
        return res.succeeded

    async def compact(self, revision: int) -> None:
        req = rpc_pb2.CompactionRequest(revision=revision, physical=True)
        await self.call(lambda ch: self._kv(ch).Compact(req, timeout=self.settings.timeout_s))

    # ---- leases ----------------------------------------------------------------

    def _leases(self, ch: grpc.aio.Channel) -> rpc_pb2_grpc.LeaseStub:
        return rpc_pb2_grpc.LeaseStub(ch)

    async def lease_grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds (etcd rounds tiny TTLs up); returns its id."""
        req = rpc_pb2.LeaseGrantRequest(TTL=ttl_s)
        resp = await self.call(
            lambda ch: self._leases(ch).LeaseGrant(req, timeout=self.settings.timeout_s)
        )
        if resp.error:
            raise EtcdError(f"lease grant refused: {resp.error}")
        return int(resp.ID)

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key attached to it."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        await self.call(
            lambda ch: self._leases(ch).LeaseRevoke(req, timeout=self.settings.timeout_s)
        )

    async def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease; -1 if it no longer exists."""
        req = rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
        resp = await self.call(
            lambda ch: self._leases(ch).LeaseTimeToLive(req, timeout=self.settings.timeout_s)
        )
        return int(resp.TTL)

    # ---- streams (implemented beside) --------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int = 0) -> AsyncIterator[WatchBatch]:
        """Every change under `prefix` after `start_revision` (0: from now), across reconnects."""
        return watch_prefix(self, prefix, start_revision)


def is_unavailable(exc: grpc.aio.AioRpcError) -> bool:
    """True when `exc` means etcd could not be reached (as opposed to a refusal)."""
    return exc.code() in _UNAVAILABLE


def _describe(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name.lower()}: {exc.details()}"


def _permanent(exc: grpc.aio.AioRpcError) -> EtcdError:
    details = exc.details() or ""
    if "lease not found" in details:
        return LeaseNotFound(details)
    return EtcdError(f"etcd refused the request ({_describe(exc)})")
