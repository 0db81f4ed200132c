"""Join tokens: the one-time, expiring secret a new machine shows to join the cluster (#65).

A token reads `<id>.<secret>` (6 and 16 characters of [0-9a-z], as kubeadm's
bootstrap tokens): `id` names the record at `/cognitora/tokens/<id>`; the
secret is never stored, only the SHA-256 of the whole token (a random
82-bit secret that expires within days needs no slow hash). Records are JSON:

    {"id": "k3x9q2", "hash": "<sha256 hex>", "created_unix": 1796521234.0,
     "expires_unix": 1796607634.0, "uses": 1, "used": 0, "note": "gpu box 2"}

`consume` spends one use, atomically (a compare-and-swap on the record's
revision: two machines racing for a single-use token cannot both win), and
says why a token is refused: malformed, unknown (or revoked), wrong secret,
expired, used up. What a joining machine pins the CA by is
`cgn_core.pki.key_hash` (`cgn-ctl pki inspect ca.pem` shows it).

This is the token store only. The signing endpoint that takes a token with a
certificate request, and `cgn-ctl up --join`, are not built yet (#65).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import secrets
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cgn_core import keys, records
from cgn_core.errors import PermanentError
from cgn_core.etcd import Compare, EtcdClient, Op

_TOKEN = re.compile(r"^([0-9a-z]{6})\.([0-9a-z]{16})$")
_ID = re.compile(r"^[0-9a-z]{6}$")
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")  # what a joining machine may be named
_HASH = re.compile(r"^[0-9a-f]{64}$")
_ALPHABET = string.digits + string.ascii_lowercase
DEFAULT_TTL_S = 24 * 3600.0
MAX_TTL_S = 30 * 86400.0  # a join token is a bootstrap secret, not a credential
MAX_USES = 1000
CAS_TRIES = 8  # a use lost to a racing consume is tried again on the fresh record


class TokenError(PermanentError):
    """A token that cannot be created, read or spent; the message says why."""


@dataclass(frozen=True, slots=True)
class JoinToken:
    id: str
    hash: str
    created_unix: float
    expires_unix: float
    uses: int = 1
    used: int = 0
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "hash": self.hash,
            "created_unix": self.created_unix,
            "expires_unix": self.expires_unix,
            "uses": self.uses,
            "used": self.used,
            "note": self.note,
        }

    def refusal(self, now_unix: float) -> str | None:
        """Why the token cannot be spent now (None: it can)."""
        if now_unix >= self.expires_unix:
            return "expired"
        if self.used >= self.uses:
            return "used up"
        return None


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(
    ttl_s: float = DEFAULT_TTL_S, uses: int = 1, note: str = "", now_unix: float | None = None
) -> tuple[str, JoinToken]:
    """A new token and its record (store the record; show the token once)."""
    if not 0 < ttl_s <= MAX_TTL_S:  # NOTE: NaN fails this too
        raise TokenError(f"ttl must be in (0, {MAX_TTL_S:.0f}] seconds (30 days), got {ttl_s}")
    if not 1 <= uses <= MAX_USES:
        raise TokenError(f"uses must be in [1, {MAX_USES}], got {uses}")
    if len(note) > 256:
        raise TokenError("a note is at most 256 characters")
    tid = "".join(secrets.choice(_ALPHABET) for _ in range(6))
    token = f"{tid}." + "".join(secrets.choice(_ALPHABET) for _ in range(16))
    now = time.time() if now_unix is None else now_unix
    return token, JoinToken(tid, token_hash(token), now, now + ttl_s, uses, 0, note)


def token_id(token: str) -> str:
    """The id part of a well-formed token; TokenError (saying nothing of the secret)."""
    m = _TOKEN.match(token)
    if m is None:
        raise TokenError("the join token is malformed (want <6 of [0-9a-z]>.<16 of [0-9a-z]>)")
    return m.group(1)


def parse(doc: Any, tid: str | None = None) -> JoinToken:
    """A stored record, every field checked (it comes from etcd)."""
    try:
        d = records.obj(doc, "join token")
        rid = records.text(d, "id", required=True)
        if not _ID.match(rid) or (tid is not None and rid != tid):
            raise records.RecordError(f"'id' {rid[:20]!r} is not this record's")
        digest = records.text(d, "hash", required=True)
        if not _HASH.match(digest):
            raise records.RecordError("'hash' must be a SHA-256 hex digest")
        uses = records.integer(d, "uses", 1, 1, MAX_USES)
        return JoinToken(
            rid,
            digest,
            records.number(d, "created_unix", 0.0, 0.0) or 0.0,
            records.number(d, "expires_unix", 0.0, 0.0) or 0.0,
            uses,
            records.integer(d, "used", 0, 0, MAX_USES),
            records.text(d, "note"),
        )
    except records.RecordError as exc:
        raise TokenError(f"join token record: {exc}") from None


class Taken(TokenError):
    """A key the spending had to find absent exists (a node id already joined)."""

    def __init__(self, key: str):
        super().__init__(f"{key} exists")
        self.key = key


async def consume(
    client: EtcdClient,
    token: str,
    now_unix: float | None = None,
    prefix: str = keys.TOKENS,
    *,
    absent: Sequence[str] = (),
    then: Sequence[Op] = (),
) -> JoinToken:
    """Spend one use of `token`: its record after the use. TokenError when it is malformed,
    unknown or revoked, wrong, expired or used up (one message for unknown and wrong: a
    caller learns nothing of which ids exist). In the same transaction, only if every key
    in `absent` is absent (else Taken, and nothing written), the ops `then` run."""
    tid = token_id(token)
    for _ in range(CAS_TRIES):
        kv = await client.get(prefix + tid)
        if kv is None:
            raise TokenError("the join token is unknown, revoked or wrong")
        try:
            doc = json.loads(kv.value)
        except (ValueError, RecursionError):
            raise TokenError(f"the join token {tid}'s record is not JSON") from None
        record = parse(doc, tid)
        if not hmac.compare_digest(record.hash, token_hash(token)):
            raise TokenError("the join token is unknown, revoked or wrong")
        now = time.time() if now_unix is None else now_unix
        if (why := record.refusal(now)) is not None:
            raise TokenError(f"the join token {tid} is {why}")
        spent = dataclasses.replace(record, used=record.used + 1)
        value = json.dumps(spent.to_json()).encode()
        compares = [Compare.mod_revision(prefix + tid, "==", kv.mod_revision)]
        compares += [Compare.create_revision(k, "==", 0) for k in absent]
        if (await client.txn(compares, [Op.put(prefix + tid, value), *then])).succeeded:
            return spent
        for key in absent:  # NOTE: lost to a key that exists, or to a racing use: told apart
            if await client.get(key) is not None:
                raise Taken(key)
    raise TokenError(f"the join token {tid} is being spent by others; try again")
