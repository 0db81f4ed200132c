"""What the router learns of each replica from every request's records (lifecycle.py): its
speed, from each answered attempt (cgn_router/routing/speed.py), for the time scorer."""

from __future__ import annotations

import time

from cgn_router.registry import Registry
from cgn_router.routing.lifecycle import AttemptEnded, Record
from cgn_router.types import EndpointId


class SpeedObserver:
    def __init__(self, registry: Registry):
        self.registry = registry

    def observe(self, record: Record) -> None:
        if type(record) is AttemptEnded and record.sample is not None:
            self.registry.learn(EndpointId(record.endpoint), record.sample, time.monotonic())
