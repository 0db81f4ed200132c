"""Which endpoint each session last went to: the affinity scorer's memory."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cgn_router.types import EndpointId


@dataclass(slots=True)
class Sessions:
    """session id → the endpoint it last went to (LRU, with a TTL)."""

    ttl_s: float
    capacity: int = 100_000
    _last: OrderedDict[str, tuple[EndpointId, float]] = field(default_factory=OrderedDict)

    def owner(self, session: str | None, now: float) -> EndpointId | None:
        if session is None:
            return None
        got = self._last.get(session)
        return got[0] if got is not None and now - got[1] < self.ttl_s else None

    def record(self, session: str | None, eid: EndpointId, now: float) -> None:
        if session is None:
            return
        self._last[session] = (eid, now)
        self._last.move_to_end(session)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
