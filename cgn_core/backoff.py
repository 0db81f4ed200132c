"""Jittered exponential backoff ("full jitter"), for reconnect and restart loops.

delay_n = uniform(base * factor**n * (1 - jitter), base * factor**n), capped at `cap`.
Tunables: `base` (first delay), `factor` (growth per failure), `cap` (maximum
delay), `jitter` (fraction of the delay that is randomised, so a fleet that
lost etcd at the same instant does not reconnect at the same instant).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    base: float = 0.1
    cap: float = 5.0
    factor: float = 2.0
    jitter: float = 0.5
    attempt: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next(self) -> float:
        """The delay before the next attempt; each call grows it until `cap`."""
        ceiling = min(self.cap, self.base * self.factor**self.attempt)
        self.attempt += 1
        return self.rng.uniform(ceiling * (1 - self.jitter), ceiling)

    def reset(self) -> None:
        """Call after a success: the next failure starts from `base` again."""
        self.attempt = 0
