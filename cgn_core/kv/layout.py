"""What a stored KV block is: its chained hash under a layout that says how to read its bytes.

A block's bytes mean something only to an engine with the same layout: dtype,
layers, KV heads, head dim, tokens per block, and the engine kind and version
that wrote them. `Layout.digest` names a layout in 16 bytes (BLAKE3 of its
canonical form); a `BlockKey` is (layout digest, block hash), so blocks of
different layouts never meet, and a reader asking with another layout finds
nothing of the writer's (a miss, like any other). The block hash is the `cgn_core.
blockhash` contract: its namespace already carries the model (and tenant).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from blake3 import blake3

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


class LayoutError(ValueError):
    """A layout descriptor that cannot describe KV blocks; the message says which field."""


@dataclass(frozen=True, slots=True)
class Layout:
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int  # tokens per block (the hash contract's 16)
    engine: str  # e.g. "cgn-infer 0.1.0": a layout change in an engine bumps this

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LayoutError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("layers", "kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 16:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.engine, str) or not 0 < len(self.engine) <= 128:
            raise LayoutError("engine must name the engine and its version (1-128 characters)")

    @property
    def block_bytes(self) -> int:
        """K and V for every layer of one block."""
        per_token = 2 * self.layers * self.kv_heads * self.head_dim * DTYPES[self.dtype]
        return per_token * self.block_size

    @property
    def digest(self) -> bytes:
        return _digest(self)

    @classmethod
    def from_json(cls, doc: Any) -> Layout:
        if not isinstance(doc, dict) or set(doc) != {f for f in cls.__dataclass_fields__}:
            raise LayoutError(
                f"a layout needs exactly these fields: {', '.join(cls.__dataclass_fields__)}"
            )
        return cls(**doc)


@functools.lru_cache(maxsize=256)
def _digest(layout: Layout) -> bytes:
    """Layouts are few and asked for on every block: computed once each."""
    canonical = json.dumps(asdict(layout), sort_keys=True, separators=(",", ":"))
    return blake3(b"cognitora.kvcached.layout.v1\0" + canonical.encode()).digest(16)


class BlockKey(NamedTuple):
    layout: bytes  # Layout.digest
    block: bytes  # the block's chained hash (32 bytes)

    def hex(self) -> str:
        return f"{self.layout.hex()}-{self.block.hex()}"

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        layout, sep, block = text.partition("-")
        try:
            key = cls(bytes.fromhex(layout), bytes.fromhex(block))
        except ValueError:
            raise LayoutError(f"not a block key: {text!r}") from None
        if not sep or len(key.layout) != 16 or len(key.block) != 32:
            raise LayoutError(f"not a block key: {text!r}")
        return key
