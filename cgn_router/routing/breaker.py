"""A per-endpoint circuit breaker (pure: the caller passes the clock).

closed ──`failures` consecutive failures──▶ open ──`open_s` later──▶ half-open
half-open lets one probe request through: success closes, failure re-opens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Breaker:
    failures_to_open: int = 3
    open_s: float = 5.0
    failures: int = 0
    opened_at: float | None = None  # None: closed
    probing: bool = False  # a half-open probe is in flight

    def blocks(self, now: float) -> bool:
        """True when no request may go to the endpoint now."""
        if self.opened_at is None:
            return False
        return now < self.opened_at + self.open_s or self.probing

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if now < self.opened_at + self.open_s else "half_open"

    def on_attempt(self, now: float) -> None:
        """A request is being sent (after `blocks` said it may)."""
        if self.opened_at is not None:
            self.probing = True

    def on_success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.probing or self.failures >= self.failures_to_open:
            self.opened_at, self.probing = now, False
