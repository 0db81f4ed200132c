"""API keys: the secret shown once, only its hash stored, with a tenant, scopes, a band and limits.

A key reads `cgn_<id>_<secret>`: `id` (8 hex digits) names the record at
`/cognitora/keys/<id>`; the 256-bit secret is never stored, only the SHA-256
of the whole key (a random 256-bit secret needs no slow hash: there is
nothing to brute-force). Records are JSON:

    {"id": "1f2e3d4c", "hash": "<sha256 hex>", "tenant": "acme", "band": "gold",
     "models": ["*"], "admin": false,
     "limits": {"rps": 20, "tokens_per_min": 200000, "concurrent": 16},
     "created_unix": 1764547200.0, "expires_unix": null, "note": ""}
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cgn_core import records
from cgn_core.budgets import Budget, parse_budget
from cgn_core.errors import PermanentError
from cgn_core.kv.blockhash import tenant_salt

_KEY = re.compile(r"^cgn_([0-9a-f]{8})_([A-Za-z0-9_-]{43})$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ApiKeyError(PermanentError):
    """A key record or request that cannot be accepted; the message says why."""


@dataclass(frozen=True, slots=True)
class Limits:
    rps: float | None = None  # requests per second (token bucket, burst = max(1, rps))
    tokens_per_min: int | None = None  # prompt + completion tokens per minute
    concurrent: int | None = None  # requests in flight at once


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    hash: str
    tenant: str
    band: str
    models: tuple[str, ...] = ("*",)
    admin: bool = False
    limits: Limits = Limits()
    created_unix: float = 0.0
    expires_unix: float | None = None
    note: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    # keys naming one group share cached prompts across their tenants (a customer's public
    # system prompt); "": the key's tenant shares with its own keys only (#58)
    kv_share_group: str = ""
    # its tenant's share of engine work within a band, against other tenants' (#58): a key
    # of weight 2 is served twice the tokens of one of weight 1 when both wait
    weight: float = 1.0
    # the key's own budget, besides its tenant's (cgn_core/budgets.py): counted from when
    # it is set; a rotated key's starts afresh
    budget: Budget = Budget()

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def expired(self, now_unix: float) -> bool:
        return self.expires_unix is not None and now_unix >= self.expires_unix

    @property
    def kv_salt(self) -> str:
        """The salt of every block hash of this key's requests: its share group's, else its
        tenant's (cgn_core/kv/blockhash.py:tenant_salt)."""
        if self.kv_share_group:
            return tenant_salt("group", self.kv_share_group)
        return tenant_salt("tenant", self.tenant)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "hash": self.hash,
            "tenant": self.tenant,
            "band": self.band,
            "models": list(self.models),
            "admin": self.admin,
            "limits": {
                "rps": self.limits.rps,
                "tokens_per_min": self.limits.tokens_per_min,
                "concurrent": self.limits.concurrent,
            },
            "created_unix": self.created_unix,
            "expires_unix": self.expires_unix,
            "note": self.note,
            "kv_share_group": self.kv_share_group,
            "weight": self.weight,
            "budget": self.budget.to_json(),
        }


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh (key id, full key)."""
    kid = secrets.token_hex(4)
    return kid, f"cgn_{kid}_{secrets.token_urlsafe(32)}"


def key_id(key: str) -> str | None:
    """The id part of a well-formed key, or None."""
    m = _KEY.match(key)
    return m.group(1) if m else None


def matches(record: KeyRecord, key: str) -> bool:
    return hmac.compare_digest(record.hash, key_hash(key))


MAX_LIMIT = 1 << 53  # what records.number reads back exactly
MAX_EXPIRES_IN_S = 10 * 365 * 86400
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0  # a tenant's share weight (virtual times stay finite)


def create(
    tenant: str,
    band: str,
    *,
    models: tuple[str, ...] = ("*",),
    admin: bool = False,
    limits: Limits = Limits(),
    expires_in_s: float | None = None,
    note: str = "",
    kv_share_group: str = "",
    weight: float = 1.0,
    budget: Budget = Budget(),
) -> tuple[str, KeyRecord]:
    """A new key and its record (store the record; show the key once)."""
    if not _TENANT.match(tenant):
        raise ApiKeyError(f"tenant {tenant!r}: use 1-64 of [A-Za-z0-9._-]")
    if kv_share_group and not _TENANT.match(kv_share_group):
        raise ApiKeyError(f"kv share group {kv_share_group!r}: use 1-64 of [A-Za-z0-9._-]")
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NOTE: NaN fails this too
        raise ApiKeyError(f"weight must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {weight}")
    if not models:
        raise ApiKeyError("a key needs at least one model (or *)")
    for name, value in (
        ("rps", limits.rps),
        ("tokens_per_min", limits.tokens_per_min),
        ("concurrent", limits.concurrent),
    ):
        if value is not None and not 0 < value <= MAX_LIMIT:  # NOTE: NaN fails this too
            raise ApiKeyError(f"limit {name} must be positive (at most {MAX_LIMIT}), got {value}")
    if expires_in_s is not None and not 0 < expires_in_s <= MAX_EXPIRES_IN_S:
        raise ApiKeyError(
            f"expires in must be a positive number of seconds (at most {MAX_EXPIRES_IN_S}, "
            f"ten years), got {expires_in_s}"
        )
    kid, key = new_key()
    now = time.time()
    record = KeyRecord(
        kid,
        key_hash(key),
        tenant,
        band,
        tuple(models),
        admin,
        limits,
        now,
        None if expires_in_s is None else now + expires_in_s,
        note,
        kv_share_group=kv_share_group,
        weight=weight,
        budget=budget,
    )
    return key, record


def parse_record(doc: Any) -> KeyRecord:
    """A stored record, every field checked (it comes from etcd); ApiKeyError names the field."""
    try:
        d = records.obj(doc, "key record")
        limits = records.obj(d.get("limits") or {}, "limits")
        models = d.get("models", ["*"])
        if (
            not isinstance(models, list)
            or not models
            or not all(isinstance(m, str) and m for m in models)
        ):
            raise records.RecordError("'models' must be a non-empty list of model names")
        digest = records.text(d, "hash", required=True)
        if not _HASH.match(digest):
            raise records.RecordError("'hash' must be a SHA-256 hex digest")
        return KeyRecord(
            id=records.text(d, "id", required=True),
            hash=digest,
            tenant=records.text(d, "tenant", required=True),
            band=records.text(d, "band", required=True),
            models=tuple(models),
            admin=records.flag(d, "admin"),
            limits=Limits(
                _positive(records.number(limits, "rps", None), "rps"),
                _positive(records.integer(limits, "tokens_per_min", 0), "tokens_per_min"),
                _positive(records.integer(limits, "concurrent", 0), "concurrent"),
            ),
            created_unix=records.number(d, "created_unix", 0.0) or 0.0,
            expires_unix=records.number(d, "expires_unix", None),
            note=records.text(d, "note"),
            kv_share_group=_share_group(records.text(d, "kv_share_group")),
            weight=_weight(records.number(d, "weight", 1.0)),
            budget=_budget(d.get("budget")),
        )
    except records.RecordError as exc:
        raise ApiKeyError(f"key record: {exc}") from None


def _weight(value: float | None) -> float:
    if value is None:
        return 1.0
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise records.RecordError(f"'weight' must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {value}")
    return float(value)


def _budget(doc: Any) -> Budget:
    try:
        return parse_budget(doc)
    except records.RecordError as exc:
        raise records.RecordError(f"'budget': {exc}") from None


def _share_group(name: str) -> str:
    if name and not _TENANT.match(name):
        raise records.RecordError("'kv_share_group' must be 1-64 of [A-Za-z0-9._-]")
    return name


def _positive(value: float | None, name: str) -> Any:
    """A limit: None or 0 means none; a negative one is refused."""
    if value is not None and value < 0:
        raise records.RecordError(f"limit '{name}' must be positive, got {value}")
    return value or None
