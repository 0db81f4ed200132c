"""Leader election on one etcd key, a lease and a transaction.

    async with Election(client, "reconciler", candidate="router-a", ttl_s=10) as e:
        await e.campaign()          # returns once this candidate leads
        ... lead while not e.lost.is_set() ...

Algorithm: the key `/cognitora/leader/<name>` is created, attached to the
candidate's lease, by a transaction that succeeds only if the key does not
exist (create_revision == 0). A candidate that loses watches the key from the
revision it read and tries again when it is deleted (resignation, or the
leader's lease expiring). Leadership ends when this candidate resigns or its
lease is lost (`lost` is set), or when its keep-alive has not been confirmed
within the TTL (`expired_locally`): a leader cut off from etcd must assume
another has taken over.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from cgn_core import keys
from cgn_core.errors import CognitoraError
from cgn_core.etcd.lease import Lease
from cgn_core.etcd.types import Compare, Op

if TYPE_CHECKING:
    from cgn_core.etcd.client import EtcdClient

LEADER_PREFIX = keys.LEADER


class Election:
    """One candidate in the election called `name`."""

    def __init__(self, client: EtcdClient, name: str, candidate: str, ttl_s: int = 10):
        self.client = client
        self.key = LEADER_PREFIX + name
        self.candidate = candidate
        self.lease = Lease(client, ttl_s)
        self.is_leader = False

    async def __aenter__(self) -> Election:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.resign()

    @property
    def lost(self) -> asyncio.Event:
        """Set when this candidate's lease is gone: it no longer leads."""
        return self.lease.lost

    @property
    def leading(self) -> bool:
        """True while this candidate won, has not resigned, and its lease is confirmed alive."""
        return self.is_leader and not self.lost.is_set() and not self.lease.expired_locally

    async def campaign(self) -> None:
        """Wait until this candidate leads."""
        if self.lease.id == 0:
            await self.lease.grant()
        value = self.candidate.encode()
        while True:
            res = await self.client.txn(
                [Compare.create_revision(self.key, "==", 0)],
                [Op.put(self.key, value, self.lease.id)],
                [Op.get(self.key)],
            )
            if res.succeeded:
                self.is_leader = True
                return
            holder = res.gets[0]
            if holder and holder[0].value == value and holder[0].lease == self.lease.id:
                self.is_leader = True  # already ours (a retried campaign)
                return
            await self._wait_for_vacancy(res.revision + 1)

    async def _wait_for_vacancy(self, from_revision: int) -> None:
        watch = self.client.watch_prefix(self.key, from_revision)
        try:
            async for batch in watch:
                if batch.resync is not None and not any(kv.key == self.key for kv in batch.resync):
                    return
                if any(e.kind == "delete" and e.kv.key == self.key for e in batch.events):
                    return
        finally:
            await watch.aclose()  # type: ignore[attr-defined]

    async def leader(self) -> str | None:
        """The current leader's candidate id, or None when nobody leads."""
        kv = await self.client.get(self.key)
        return kv.value.decode() if kv is not None else None

    async def resign(self) -> None:
        """Give up leadership (if held) and the lease; safe to call more than once."""
        if self.is_leader and not self.lost.is_set():
            with contextlib.suppress(CognitoraError):
                await self.client.txn(
                    [Compare.value(self.key, "==", self.candidate.encode())], [Op.delete(self.key)]
                )
        self.is_leader = False
        await self.lease.close(revoke=True)
