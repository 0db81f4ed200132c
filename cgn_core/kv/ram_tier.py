"""The RAM tier: KV blocks in memory under a byte budget, least recently used out first.

Pure (no I/O). A block is addressed by its `BlockKey` (the layout's digest and
the block's chained hash, see `layout.py`). `put` stores a block and returns
what it evicted to make room, oldest first, so the caller can write those to
the SSD tier (write-behind). A block being streamed to a reader is pinned:
pinned blocks are never evicted, and a `put` that would need them evicted is
refused (`RamFull`) rather than exceed the budget. `get` refreshes recency.

Tunable: `budget_bytes` (`--ram-bytes`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from cgn_core.kv.layout import BlockKey


class RamFull(Exception):
    """No room for a block without evicting pinned ones (or it is larger than the budget)."""


@dataclass(slots=True)
class RamTier:
    budget_bytes: int
    used_bytes: int = 0
    _blocks: OrderedDict[BlockKey, bytes] = field(default_factory=OrderedDict)  # LRU first
    _pins: Counter[BlockKey] = field(default_factory=Counter)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> bytes | None:
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def put(self, key: BlockKey, data: bytes) -> list[tuple[BlockKey, bytes]]:
        """Store `data` under `key`; returns the blocks evicted for it, oldest first."""
        size = len(data)
        if size > self.budget_bytes:
            raise RamFull(f"a {size}-byte block exceeds the RAM budget of {self.budget_bytes}")
        old = self._blocks.get(key)
        if old is not None:  # the same block again: a refresh, its bytes are equal
            self._blocks.move_to_end(key)
            return []
        victims = self._victims(size)
        evicted = [(k, self._remove(k)) for k in victims]
        self._blocks[key] = data
        self.used_bytes += size
        return evicted

    def pin(self, key: BlockKey) -> bool:
        """Keep `key` in RAM until `unpin`; False when it is not here."""
        if key not in self._blocks:
            return False
        self._pins[key] += 1
        return True

    def unpin(self, key: BlockKey) -> None:
        if self._pins.get(key, 0) <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] -= 1

    def pinned(self, key: BlockKey) -> bool:
        return self._pins[key] > 0

    def discard(self, key: BlockKey) -> bytes | None:
        """Drop `key` (an admin eviction); pinned blocks stay. Returns its bytes if dropped."""
        if key not in self._blocks or self.pinned(key):
            return None
        return self._remove(key)

    def block_keys(self) -> list[BlockKey]:
        return list(self._blocks)

    def _victims(self, size: int) -> list[BlockKey]:
        """The least recently used unpinned blocks whose removal makes room for `size`."""
        need = self.used_bytes + size - self.budget_bytes
        victims: list[BlockKey] = []
        for k, data in self._blocks.items():
            if need <= 0:
                break
            if self._pins[k] > 0:
                continue
            victims.append(k)
            need -= len(data)
        if need > 0:
            raise RamFull("the RAM tier is full of blocks being read (pinned)")
        return victims

    def _remove(self, key: BlockKey) -> bytes:
        data = self._blocks.pop(key)
        self.used_bytes -= len(data)
        return data
