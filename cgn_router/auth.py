"""API-key authentication, model scopes and per-key limits at the router's front door.

Keys come from etcd (`/cognitora/keys/<id>`, written by `cgn-ctl keys`) and
change while the router runs: a revoked key fails on its next request.
`authenticate` maps the Authorization header to a Principal (401 when the key
is missing, malformed, unknown, revoked or expired); `may_use` checks the
model scope (a model outside it is answered as one that does not exist, a 404:
a scoped key cannot tell the two apart); `Limiter.acquire` applies the key's limits (429 with a
Retry-After): requests per second and tokens per minute as token buckets
(tokens are charged with the prompt on admission and the completion when the
usage is known), and a cap on requests in flight. With several workers
(`--workers`), the usage lives in memory they share (shared.py): a key's
limits hold for the router as a whole.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from cgn_core.apikeys import KeyRecord, Limits, key_id, matches
from cgn_core.errors import Forbidden, InvalidRequest, RateLimited, Unauthorized
from cgn_router.workers.shared import SharedUsage, Slot


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str  # "" when auth is off
    tenant: str
    band: str
    record: KeyRecord | None = None
    # the block-hash salt of its requests (its key's tenant or share group); None: unsalted,
    # the one anonymous tenant while auth is off (or isolation is switched off)
    kv_salt: str | None = None


class KeyStore:
    def __init__(self) -> None:
        self.records: dict[str, KeyRecord] = {}
        self.synced = False

    def replace(self, records: dict[str, KeyRecord]) -> None:
        """All records at once (a listing, each already validated)."""
        self.records = dict(records)
        self.synced = True

    def put(self, kid: str, record: KeyRecord) -> None:
        self.records[kid] = record

    def delete(self, kid: str) -> None:
        self.records.pop(kid, None)

    def authenticate(self, header: str | None, now_unix: float | None = None) -> Principal:
        if not header:
            raise Unauthorized(
                "missing API key (Authorization: Bearer cgn_...)", code="missing_key"
            )
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized(
                "the Authorization header must be 'Bearer <key>'", code="invalid_key"
            )
        kid = key_id(key.strip())
        record = self.records.get(kid) if kid else None
        if record is None or not matches(record, key.strip()):
            raise Unauthorized("invalid or revoked API key", code="invalid_key")
        if record.expired(time.time() if now_unix is None else now_unix):
            raise Unauthorized("this API key has expired", code="expired_key")
        return Principal(record.id, record.tenant, record.band, record, record.kv_salt)


def may_use(p: Principal, model: str) -> bool:
    return p.record is None or p.record.allows(model)


def visible(p: Principal, models: Mapping[str, str]) -> dict[str, str]:
    """The names (aliases too, with the model each means) a key may use: a key scoped to
    some models learns nothing of the others, in /v1/models or in a 404."""
    return {name: m for name, m in models.items() if may_use(p, m)}


def authorize_admin(p: Principal) -> None:
    """Management APIs need a key created with --admin (any key while auth is off)."""
    if p.record is not None and not p.record.admin:
        raise Forbidden(
            "this API key has no admin scope (cgn-ctl keys create --admin)", code="admin_required"
        )


@dataclass
class Bucket:
    rate: float  # tokens per second
    capacity: float
    level: float = 0.0
    at: float = 0.0

    def refill(self, now: float) -> None:
        if self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        else:
            self.level = self.capacity
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0: now)."""
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate


@dataclass
class KeyUsage:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    in_flight: int = 0

    @classmethod
    def fresh(cls, lim: Limits) -> KeyUsage:
        return cls(
            Bucket(lim.rps, max(1.0, lim.rps)) if lim.rps else None,
            Bucket(lim.tokens_per_min / 60.0, float(lim.tokens_per_min))
            if lim.tokens_per_min
            else None,
        )

    @classmethod
    def loaded(cls, lim: Limits, slot: Slot) -> KeyUsage:
        """The usage a shared slot holds, under the key's current limits."""
        u = cls.fresh(lim)
        if u.requests:
            u.requests.level, u.requests.at = slot.requests_level, slot.requests_at
        if u.tokens:
            u.tokens.level, u.tokens.at = slot.tokens_level, slot.tokens_at
        u.in_flight = slot.in_flight
        return u

    def store(self, slot: Slot) -> None:
        if self.requests:
            slot.requests_level, slot.requests_at = self.requests.level, self.requests.at
        if self.tokens:
            slot.tokens_level, slot.tokens_at = self.tokens.level, self.tokens.at
        slot.in_flight = self.in_flight


@dataclass
class Limiter:
    usage: dict[str, KeyUsage] = field(default_factory=dict)
    shared: SharedUsage | None = None  # the workers' table; None: this process counts alone

    @contextmanager
    def _using(self, p: Principal) -> Iterator[KeyUsage | None]:
        """`p`'s usage for the block (None: a key without limits, or no key)."""
        if p.record is None:
            yield None
            return
        if self.shared is not None:
            with self.shared.use(p.key_id) as slot:
                if slot is not None:
                    u = KeyUsage.loaded(p.record.limits, slot)
                    try:
                        yield u
                    finally:
                        u.store(slot)  # a refusal's refund is kept too
                    return
        own = self.usage.get(p.key_id)
        if own is None:
            own = self.usage[p.key_id] = KeyUsage.fresh(p.record.limits)
        yield own

    def acquire(self, p: Principal, prompt_tokens: int, now: float | None = None) -> None:
        """Admit one request of `p` or raise RateLimited with the seconds to wait."""
        with self._using(p) as u:
            if u is None:
                return
            self._acquire(p.record.limits, u, prompt_tokens, now)  # type: ignore[union-attr]

    @staticmethod
    def _acquire(lim: Limits, u: KeyUsage, prompt_tokens: int, now: float | None) -> None:
        t = time.monotonic() if now is None else now
        if lim.concurrent is not None and u.in_flight >= lim.concurrent:
            why = f"{u.in_flight} requests in flight; the key allows {lim.concurrent}"
            raise RateLimited(why, code="concurrency_limit", retry_after_s=1)
        checks = (
            (u.requests, 1.0, "requests per second"),
            (u.tokens, float(prompt_tokens), "tokens per minute"),
        )
        for bucket, amount, what in checks:
            if bucket is None:
                continue
            bucket.refill(t)
            wait = bucket.wait_for(min(amount, bucket.capacity))
            if wait > 0:
                why = f"the key's {what} limit is reached"
                raise RateLimited(why, code="rate_limit", retry_after_s=max(1, math.ceil(wait)))
        if u.requests:
            u.requests.level -= 1
        if u.tokens:
            u.tokens.level -= prompt_tokens
        u.in_flight += 1

    def settle(self, p: Principal, estimate: int, exact: int, now: float | None = None) -> None:
        """Replace the prompt estimate `acquire` charged with the exact count. RateLimited
        (the estimate refunded) when the exact count would not have been admitted: an
        over-budget prompt is refused before it is forwarded, not after; InvalidRequest
        (400, refunded too) for a prompt larger than the key's whole budget, which no wait
        would ever admit."""
        with self._using(p) as u:
            if u is None or not u.tokens:
                return
            bucket = u.tokens
            before = bucket.level + estimate  # what the key held when this request came
            if exact > bucket.capacity:
                bucket.level = min(bucket.capacity, before)
                raise InvalidRequest(
                    f"the prompt's {exact} tokens exceed the key's whole budget of "
                    f"{bucket.capacity:.0f} tokens per minute",
                    code="prompt_over_budget",
                )
            if exact > estimate and before < min(exact, bucket.capacity):
                bucket.level = min(bucket.capacity, before)
                bucket.refill(time.monotonic() if now is None else now)
                wait = bucket.wait_for(min(exact, bucket.capacity))
                why = f"the key's tokens per minute limit is reached ({exact} prompt tokens)"
                raise RateLimited(why, code="rate_limit", retry_after_s=max(1, math.ceil(wait)))
            bucket.level = min(bucket.capacity, before - exact)

    def release(self, p: Principal, completion_tokens: int = 0) -> None:
        with self._using(p) as u:
            if u is None:
                return
            u.in_flight = max(0, u.in_flight - 1)
            if u.tokens and completion_tokens:
                u.tokens.level -= completion_tokens  # may go negative: the next waits it off
