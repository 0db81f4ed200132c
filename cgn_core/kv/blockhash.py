"""Block identities shared by the router, the engines and the KV store (docs/architecture.md).

A prompt's token ids (after templating and tokenization) are cut into blocks
of BLOCK_SIZE = 16 consecutive tokens; only full blocks are hashed. Hashes
chain, so a block's identity covers every token before it:

    h_0 = 32 zero bytes
    h_i = BLAKE3(b"cognitora.kv.v1\\0" + namespace + b"\\0" + h_{i-1}
                 + tokens_i as uint32 little-endian)

`namespace` is the model name, plus "|" + salt where a tenant or adapter salt
is configured, so two models (or two tenants) never share a block identity.
A tenant's salt (`tenant_salt`) is derived from its name, or from the KV share group
its keys name, by the router from the authenticated key only (never from the client):

    salt = hex(BLAKE3(b"cognitora.kv.salt.v1\0" + kind + b"\0" + name))[:32]

with kind "tenant" or "group", so a group never shares blocks with a tenant of its name.
A request for a LoRA adapter hashes under `adapter_salt`: its tenant's salt and the
adapter's name.
Published vectors: cgn_core/kv/testdata/blockhash_vectors.json.
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import NewType

from blake3 import blake3

BlockHash = NewType("BlockHash", bytes)

BLOCK_SIZE = 16
DOMAIN = b"cognitora.kv.v1\0"
ROOT = BlockHash(bytes(32))
_U32 = next(code for code in "IL" if array(code).itemsize == 4)  # the C type of 32 bits


def namespace(model: str, salt: str | None = None) -> str:
    """The hash namespace for `model`, salted per tenant or adapter when `salt` is set."""
    if not model:
        raise ValueError("block-hash namespace needs a model name")
    return salted(model, salt)


SALT_DOMAIN = b"cognitora.kv.salt.v1\0"
SALT_KINDS = ("tenant", "group")
MAX_SALT = 128  # characters: an engine refuses a longer salt header
_SALT = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_SALT}}}")


def valid_salt(salt: str) -> bool:
    """Whether `salt` may travel as a header and join a namespace: 1-MAX_SALT of
    [A-Za-z0-9._:-] (a derived salt is 32 hex digits)."""
    return _SALT.fullmatch(salt) is not None


def tenant_salt(kind: str, name: str) -> str:
    """The KV salt of tenant `name` (kind "tenant") or of share group `name` ("group")."""
    if kind not in SALT_KINDS or not name:
        raise ValueError(f"a KV salt is derived from a tenant or a group name, got {kind!r}")
    digest = blake3(SALT_DOMAIN + kind.encode() + b"\0" + name.encode("utf-8")).hexdigest()
    return digest[:32]


def adapter_salt(salt: str | None, adapter: str | None, scale: float = 1.0) -> str | None:
    """The salt of a request for LoRA `adapter` at `scale` (None: the base model) from a
    tenant of `salt` (None: unsalted): a namespace of its own, so an adapter's blocks are
    never the base's, another adapter's or its own at another scale (the same tokens
    through other weights hold other KV)

        hex(BLAKE3(b"cognitora.kv.salt.v1\0adapter\0" + salt + b"\0" + adapter
                   [+ b"@" + repr(scale) where scale != 1]))[:32]
    """
    if adapter is None:
        return salt
    inner = (salt or "").encode() + b"\0" + adapter.encode("utf-8")
    if scale != 1.0:
        inner += b"@" + repr(float(scale)).encode()
    return blake3(SALT_DOMAIN + b"adapter\0" + inner).hexdigest()[:32]


def salted(ns: str, salt: str | None) -> str:
    """Namespace `ns` (a model's) under `salt`; `ns` itself when there is none."""
    return f"{ns}|{salt}" if salt else ns


def block_hash(parent: BlockHash, tokens: Sequence[int], ns: str) -> BlockHash:
    """The hash of one full block of BLOCK_SIZE token ids following `parent`."""
    if len(tokens) != BLOCK_SIZE:
        raise ValueError(f"a block holds exactly {BLOCK_SIZE} tokens, got {len(tokens)}")
    (h,) = iter_block_hashes(tokens, ns, parent)
    return h


def block_hashes(tokens: Sequence[int], ns: str, parent: BlockHash = ROOT) -> list[BlockHash]:
    """Chained hashes of every full block of `tokens`; a trailing partial block is ignored."""
    return list(iter_block_hashes(tokens, ns, parent))


def iter_block_hashes(
    tokens: Sequence[int], ns: str, parent: BlockHash = ROOT
) -> Iterator[BlockHash]:
    """Lazily yield the chained block hashes (stop early once a lookup misses)."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    prefix = _prefix(ns)
    full = len(tokens) - len(tokens) % BLOCK_SIZE
    packed = _pack_all(tokens[:full])  # one C call for every block, not one pack per block
    step = 4 * BLOCK_SIZE
    for start in range(0, len(packed), step):
        parent = BlockHash(blake3(prefix + parent + packed[start : start + step]).digest())
        yield parent


def _pack_all(tokens: Sequence[int]) -> bytes:
    """The token ids as uint32 little-endian; ValueError for ids outside [0, 2**32)."""
    try:
        ids = array(_U32, tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def _prefix(ns: str) -> bytes:
    return DOMAIN + ns.encode("utf-8") + b"\0"
