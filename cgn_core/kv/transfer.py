"""`kv_transfer_params`: the request field that chains a prefill leg to a decode leg.

The two-leg protocol is vLLM's disaggregated-prefill proxy's: the prefill leg
is the client's request with `max_tokens: 1`, `stream: false` and
`"kv_transfer_params": {"do_remote_decode": true}`; the prefill engine
computes the prompt, holds its full KV blocks for a while and answers with
`"kv_transfer_params": {"do_remote_prefill": true, "remote_host": H,
"remote_port": P, ...}`; the decode leg is the client's request with that
object added, and the decode engine fetches the prompt's blocks from H:P
(the KvCache gRPC service, proto/cognitora/v1/kvcached.proto, addressed by
block hash) before it computes anything. Blocks are addressed by the
block-hash contract, not by block ids, so `remote_block_ids` is not needed;
`remote_engine_id` and `remote_block_count` are informational.

Parsing is strict (nothing from the network is trusted): an unknown key or
a wrong type is an `InvalidRequest` naming `kv_transfer_params.<key>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cgn_core.errors import InvalidRequest

FIELD = "kv_transfer_params"
# A decode leg's answer says how its prompt's KV arrived: "fetched N blocks", "nothing to
# fetch (...)" or "fallback: <reason>" (the engine recomputed; the router counts the reason).
HEADER = "x-cgn-kv-transfer"
_FALLBACK = "fallback: "


def fallback_note(reason: str) -> str:
    """The `HEADER` value of a decode leg that recomputed, for `reason`."""
    return _FALLBACK + reason


def fallback_reason(note: str) -> str | None:
    """The reason in a `HEADER` value that says the decode leg recomputed; None otherwise."""
    return note.removeprefix(_FALLBACK) if note.startswith(_FALLBACK) else None


_TYPES: dict[str, type] = {
    "do_remote_decode": bool,
    "do_remote_prefill": bool,
    "remote_host": str,
    "remote_port": int,
    "remote_engine_id": str,
    "remote_block_count": int,
}


@dataclass(frozen=True, slots=True)
class TransferParams:
    do_remote_decode: bool = False  # prefill leg: hold the prompt's KV for a decode engine
    do_remote_prefill: bool = False  # decode leg: fetch the prompt's KV from remote_host:port
    remote_host: str = ""
    remote_port: int = 0
    remote_engine_id: str = ""
    remote_block_count: int = 0

    @property
    def address(self) -> str:
        host = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host
        return f"{host}:{self.remote_port}"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _TYPES if getattr(self, k) != _DEFAULTS[k]}


_DEFAULTS = {k: getattr(TransferParams(), k) for k in _TYPES}


def parse_transfer_params(value: Any) -> TransferParams:
    """The request's `kv_transfer_params`, checked."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"'{FIELD}' must be an object", param=FIELD)
    for key, v in value.items():
        want = _TYPES.get(key)
        if want is None:
            raise InvalidRequest(f"unsupported key '{FIELD}.{key}'", param=f"{FIELD}.{key}")
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise InvalidRequest(f"'{FIELD}.{key}' must be {want.__name__}", param=f"{FIELD}.{key}")
    p = TransferParams(**value)
    if p.do_remote_decode and p.do_remote_prefill:
        raise InvalidRequest(
            f"'{FIELD}': a leg is either the prefill (do_remote_decode) or the decode "
            "(do_remote_prefill), not both",
            param=FIELD,
        )
    if p.do_remote_prefill and (not p.remote_host or not 0 < p.remote_port < 65536):
        raise InvalidRequest(
            f"'{FIELD}.do_remote_prefill' needs remote_host and a remote_port in 1..65535",
            param=f"{FIELD}.remote_host",
        )
    if p.remote_block_count < 0:
        raise InvalidRequest(
            f"'{FIELD}.remote_block_count' must not be negative",
            param=f"{FIELD}.remote_block_count",
        )
    return p
