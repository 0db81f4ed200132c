"""One attempt's hold on an endpoint, as a context manager: every leg (a client's request, a
P/D prefill leg) accounts the same way.

    with Attempt(registry, view, req) as lease:   # Registry.begin: in flight, pending prefill
        ... proxy.run(call, lease) / proxy.exchange(call); lease.first_byte() ...
        attempt.outcome = "ok"                     # or what the relay says
    # lease.end(outcome): "failed"/"busy" when AttemptFailed escaped (the breaker's view),
    # "client_disconnected" when anything else did (aiohttp cancels a handler whose client left)
"""

from __future__ import annotations

import time
from types import TracebackType

from cgn_router.proxy import AttemptFailed
from cgn_router.registry import Lease, Outcome, Registry
from cgn_router.types import EndpointView, RequestInfo


class Attempt:
    def __init__(
        self, registry: Registry, view: EndpointView, req: RequestInfo, *, streamed: bool = False
    ) -> None:
        self.lease = registry.begin(view, req, time.monotonic(), streamed=streamed)
        self.outcome: Outcome = "client_disconnected"  # until the attempt says otherwise

    def __enter__(self) -> Lease:
        return self.lease

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, AttemptFailed):
            self.outcome = "failed" if exc.breaker else "busy"
        self.lease.end(self.outcome, time.monotonic())
