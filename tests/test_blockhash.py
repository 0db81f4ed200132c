"""The block-hash contract (docs/architecture.md, block-hash contract) against its committed vectors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

from cgn_core.kv import blockhash
from cgn_core.kv.blockhash import (
    BLOCK_SIZE,
    ROOT,
    adapter_salt,
    block_hash,
    block_hashes,
    namespace,
    tenant_salt,
    valid_salt,
)

VECTORS = json.loads(
    (Path(blockhash.__file__).parent / "testdata" / "blockhash_vectors.json").read_text()
)


def reference(tokens: list[int], ns: str) -> list[str]:
    """A deliberately naive re-statement of the spec, independent of the implementation."""
    out, parent = [], bytes(32)
    for i in range(len(tokens) // 16):
        block = tokens[16 * i : 16 * i + 16]
        data = b"cognitora.kv.v1\x00" + ns.encode() + b"\x00" + parent
        data += b"".join(struct.pack("<I", t) for t in block)
        parent = blake3(data).digest()
        out.append(parent.hex())
    return out


def test_vector_file_covers_the_edge_cases() -> None:
    assert VECTORS["scheme"] == "cognitora.kv.v1" and VECTORS["block_size"] == BLOCK_SIZE
    names = {v["name"] for v in VECTORS["vectors"]}
    assert {"empty prompt", "partial block only", "tenant salt", "max token id"} <= names
    assert {"tenant acme's derived salt", "group acme's derived salt"} <= names


@pytest.mark.parametrize("vec", VECTORS["salts"], ids=lambda v: f"{v['kind']}-{v['name']}")
def test_tenant_salt_vectors(vec: dict) -> None:
    domain = b"cognitora.kv.salt.v1\x00" + vec["kind"].encode() + b"\x00"
    expected = blake3(domain + vec["name"].encode()).hexdigest()[:32]  # the reference
    assert tenant_salt(vec["kind"], vec["name"]) == vec["salt"] == expected


@pytest.mark.parametrize("vec", VECTORS["adapter_salts"], ids=lambda v: v["adapter"])
def test_adapter_salt_vectors(vec: dict) -> None:
    """A LoRA adapter's requests hash in a namespace of their own, per tenant (#60)."""
    inner = (vec["salt"] or "").encode() + b"\x00" + vec["adapter"].encode()
    expected = blake3(b"cognitora.kv.salt.v1\x00adapter\x00" + inner).hexdigest()[:32]
    assert adapter_salt(vec["salt"], vec["adapter"]) == vec["expected"] == expected
    assert valid_salt(vec["expected"]) and vec["expected"] != vec["salt"]
    assert adapter_salt(vec["salt"], None) == vec["salt"]  # the base: the tenant's own
    half = adapter_salt(vec["salt"], vec["adapter"], 0.5)  # another scale, other KV
    assert half == blake3(b"cognitora.kv.salt.v1\x00adapter\x00" + inner + b"@0.5").hexdigest()[:32]


def test_a_group_and_a_tenant_of_one_name_never_share_a_salt() -> None:
    assert tenant_salt("tenant", "acme") != tenant_salt("group", "acme")
    with pytest.raises(ValueError, match="tenant or a group"):
        tenant_salt("user", "acme")


@pytest.mark.parametrize("vec", VECTORS["vectors"], ids=lambda v: v["name"])
def test_vectors(vec: dict) -> None:
    ns = namespace(vec["model"], vec["salt"])
    assert ns == vec["namespace"]
    assert [h.hex() for h in block_hashes(vec["tokens"], ns)] == vec["hashes"]
    assert reference(vec["tokens"], ns) == vec["hashes"]
    assert len(vec["hashes"]) == len(vec["tokens"]) // BLOCK_SIZE


def test_salt_and_model_separate_identities() -> None:
    toks = list(range(16))
    a = block_hashes(toks, namespace("m"))
    assert a != block_hashes(toks, namespace("m", "tenant"))
    assert a != block_hashes(toks, namespace("m2"))
    assert namespace("m", "") == "m"


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="0, 2\\*\\*32"):
        block_hashes([-1] * 16, "m")
    with pytest.raises(ValueError, match="0, 2\\*\\*32"):
        block_hashes([2**32] * 16, "m")
    with pytest.raises(ValueError, match="exactly 16"):
        block_hash(ROOT, [1, 2], "m")
    with pytest.raises(ValueError, match="model name"):
        namespace("")


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=80),
    st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=48),
)
def test_hashes_extend(prefix: list[int], more: list[int]) -> None:
    """Appending tokens never changes the hashes of the blocks already complete."""
    full = prefix[: len(prefix) // 16 * 16]
    head = block_hashes(full, "m")
    whole = block_hashes(full + more, "m")
    assert whole[: len(head)] == head
    # Chaining from the last hash equals hashing the whole prompt.
    tail = block_hashes(more, "m", parent=head[-1] if head else ROOT)
    assert whole[len(head) :] == tail
