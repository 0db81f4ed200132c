"""A lease kept alive in the background, across etcd restarts.

    async with Lease(client, ttl_s=10) as lease:
        await client.put(key, value, lease=lease.id)
        ...                      # keys live while the block runs
    # leaving the block cancels the keep-alive and revokes the lease

Algorithm: a keep-alive stream refreshes the lease every ttl/3. When the
stream breaks (etcd restarted, network blip) the task reconnects with
jittered backoff, forever: etcd extends every lease's deadline when a leader
(re-)starts, so a lease often survives an etcd restart. Only etcd's own
answer that the lease is gone (TTL <= 0) sets `lost`; `expired_locally`
tells a cautious holder (a leader) that no refresh was confirmed within the
TTL, so it must act as if the lease were gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import grpc.aio

from cgn_core.backoff import Backoff
from cgn_core.errors import CognitoraError
from cgn_proto.etcd import rpc_pb2, rpc_pb2_grpc

if TYPE_CHECKING:
    from cgn_core.etcd.client import EtcdClient

log = logging.getLogger(__name__)


class Lease:
    """A granted etcd lease with an owned keep-alive task."""

    def __init__(self, client: EtcdClient, ttl_s: int):
        self.client = client
        self.ttl_s = ttl_s
        self.id = 0
        self.lost = asyncio.Event()
        self.connected = False  # the last keep-alive round trip succeeded
        self._confirmed_until = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lease:
        await self.grant()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(revoke=True)

    async def grant(self) -> None:
        """Grant the lease and start keeping it alive."""
        self.id = await self.client.lease_grant(self.ttl_s)
        self.connected = True
        self._confirmed_until = time.monotonic() + self.ttl_s
        self._task = asyncio.create_task(self._keepalive(), name=f"lease-{self.id:x}")
        self._task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        # NOTE: a keep-alive that dies of an unexpected error must not look alive.
        if not task.cancelled() and task.exception() is not None:
            log.error("lease %x keep-alive failed: %r", self.id, task.exception())
            self.lost.set()

    @property
    def expired_locally(self) -> bool:
        """No refresh confirmed within the TTL: etcd may have dropped the lease."""
        return time.monotonic() > self._confirmed_until

    async def close(self, *, revoke: bool) -> None:
        """Stop the keep-alive; with `revoke`, also revoke the lease (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if revoke and self.id and not self.lost.is_set():
            try:
                await self.client.lease_revoke(self.id)
            except CognitoraError as exc:  # etcd down or lease gone: it will expire anyway
                log.info("lease %x not revoked (%s); it expires on its own", self.id, exc)

    async def _keepalive(self) -> None:
        backoff = Backoff(base=0.1, cap=2.0)
        interval = max(self.ttl_s / 3, 0.2)
        while not self.lost.is_set():
            call = rpc_pb2_grpc.LeaseStub(self.client.channel()).LeaseKeepAlive()
            try:
                while True:
                    await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=self.id))
                    # NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                    # cancellation that races with the read completing, and then close() hangs.
                    async with asyncio.timeout(self.client.settings.timeout_s):
                        resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise ConnectionError("keep-alive stream closed by etcd")
                    if resp.TTL <= 0:
                        log.warning("lease %x is gone (expired or revoked)", self.id)
                        self.lost.set()
                        return
                    self._confirmed_until = time.monotonic() + resp.TTL
                    self.connected = True
                    backoff.reset()
                    await asyncio.sleep(interval)
            except (
                grpc.aio.AioRpcError,
                asyncio.InvalidStateError,
                ConnectionError,
                TimeoutError,
            ) as exc:
                self.connected = False
                self.client.rotate()
                delay = backoff.next()
                log.warning("lease %x keep-alive: %s; retrying in %.2fs", self.id, exc, delay)
                await asyncio.sleep(delay)
            finally:
                call.cancel()
