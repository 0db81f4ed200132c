"""`cgn_resume`: another engine continues a streamed answer (request migration).

The router and a capable engine (cgn-infer) agree on two things:

1. **Token ids on the stream.** A request carrying the header `x-cgn-token-ids: 1`
   (from a caller holding the engine's token) is answered with each token's SSE
   events written at once, the first of them preceded by one comment line,
   `: ids 791,13,2`, naming every token id produced since the previous such line
   (a token whose text is still held back, by the detokenizer, a stop string or a
   tool-call parser, is named with the next text that goes out). So the text a
   client has received is always what the named ids produce, and SSE clients
   ignore comment lines (the router strips them anyway).
2. **A continuation.** The same request body plus `"cgn_resume": {"token_ids":
   [...], "id": "chatcmpl-...", "created": 1733227200}`: the engine treats the ids
   as already generated. It computes the prompt plus those ids (restoring what its
   pool or the node's cgn-kvcached holds), advances everything that depends on
   the output over them (stop strings, the detokenizer, the tool-call parser, a
   grammar's state, penalties, a seeded sampler's draws), and streams on with the
   given response id and creation time, no role chunk, and one usage that counts
   the prompt once and the completion across both engines.

Greedy answers continue exactly; a seeded sampled one too, since a sampler draws
once per token. The field is accepted from the router only (it is refused from
clients like `kv_transfer_params`), and for streamed requests only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cgn_core.errors import InvalidRequest

FIELD = "cgn_resume"
IDS_HEADER = "x-cgn-token-ids"
IDS_PREFIX = b": ids "
MAX_IDS = 1 << 17  # generated tokens a continuation may carry (more than any context here)
_KEYS = frozenset({"token_ids", "id", "created"})


@dataclass(frozen=True, slots=True)
class Resume:
    token_ids: tuple[int, ...]
    response_id: str  # the answer's id, kept across engines
    created: int

    def to_json(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "id": self.response_id, "created": self.created}


def parse_resume(value: Any) -> Resume:
    """A `cgn_resume` object; InvalidRequest names the bad key."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{FIELD}' must be an object", param=FIELD)
    if unknown := sorted(value.keys() - _KEYS):
        raise InvalidRequest(f"unknown key '{FIELD}.{unknown[0]}'", param=f"{FIELD}.{unknown[0]}")
    ids = value.get("token_ids")
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_IDS
        or not all(type(t) is int and 0 <= t < 1 << 31 for t in ids)
    ):
        raise InvalidRequest(
            f"'{FIELD}.token_ids' must be a list of at most {MAX_IDS} token ids",
            param=f"{FIELD}.token_ids",
        )
    rid, created = value.get("id"), value.get("created")
    if not isinstance(rid, str) or not 0 < len(rid) <= 128 or not rid.isascii():
        raise InvalidRequest(f"'{FIELD}.id' must be a response id", param=f"{FIELD}.id")
    if type(created) is not int or not 0 <= created < 1 << 40:
        raise InvalidRequest(f"'{FIELD}.created' must be a Unix time", param=f"{FIELD}.created")
    return Resume(tuple(ids), rid, created)


def ids_line(ids: Iterable[int]) -> bytes:
    """The comment line that names `ids` on a stream."""
    return IDS_PREFIX + ",".join(map(str, ids)).encode() + b"\n"
