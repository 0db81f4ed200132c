"""What the agent wants etcd to say, and the pushing of it there, across etcd outages.

Every key the agent owns (its node, its replicas' status, its Ready
endpoints) is attached to the agent's lease. The publisher holds the desired
value of each key; `set` and `delete` only change that picture and mark the
key dirty. `flush` pushes the dirty keys; after any etcd failure, or with a
new lease, the next flush re-sends every key ("re-sent on every reconnect")
and deletes the ones withdrawn meanwhile. Nothing is lost while etcd is
away: the picture keeps changing in memory and lands when it returns.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from cgn_core.errors import CognitoraError


class KeyWriter(Protocol):
    async def put(self, key: str, value: bytes | str, lease: int = 0) -> int: ...

    async def delete(self, key: str, *, prefix: bool = False) -> int: ...


class Publisher:
    def __init__(self) -> None:
        self.desired: dict[str, str] = {}
        self.dirty: set[str] = set()
        self.resync = True
        self.changed = asyncio.Event()
        self.flushes = 0  # successful flushes (tests and metrics read it)

    def set(self, key: str, doc: Any) -> None:
        value = json.dumps(doc, separators=(",", ":"), sort_keys=True)
        if self.desired.get(key) != value:
            self.desired[key] = value
            self.dirty.add(key)
            self.changed.set()

    def delete(self, key: str) -> None:
        if self.desired.pop(key, None) is not None:
            self.dirty.add(key)
            self.changed.set()

    def value(self, key: str) -> Any:
        raw = self.desired.get(key)
        return None if raw is None else json.loads(raw)

    async def flush(self, etcd: KeyWriter, lease: int) -> None:
        """Push changes (everything after a failure or a new lease); raises on etcd errors."""
        self.changed.clear()
        keys = sorted(set(self.desired) | self.dirty) if self.resync else sorted(self.dirty)
        try:
            for key in keys:
                value = self.desired.get(key)
                if value is None:
                    await etcd.delete(key)
                else:
                    await etcd.put(key, value, lease=lease)
                if self.desired.get(key) == value:  # NOTE: not changed again while we awaited
                    self.dirty.discard(key)
        except CognitoraError:
            self.resync = True
            raise
        self.resync = False
        self.flushes += 1
