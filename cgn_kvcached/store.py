"""The node's KV block store: the RAM tier in front of the SSD tier (no network, no threads).

* `put`: into RAM; blocks RAM evicts to make room go to the SSD (write-behind),
  or the new block too at once with `write_through`. A block RAM cannot take
  (every other block pinned) goes straight to the SSD.
* `get`: RAM, else SSD (a block read from the SSD is promoted to RAM).
* `lookup`: for a chain of block keys, the tier of each block of the longest
  prefix present (a chain stops at its first miss: later blocks are useless
  without it).
* A full or failing SSD degrades the store to RAM only, with a warning and
  `ssd_degraded`; a write is tried on the SSD again after `ssd_retry_s`.

The gRPC service (not built yet: issue #19) is the shell around this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from cgn_kvcached.layout import BlockKey
from cgn_kvcached.ram_tier import RamFull, RamTier
from cgn_kvcached.ssd_tier import SsdFull, SsdTier

log = logging.getLogger(__name__)
Tier = Literal["ram", "ssd"]


@dataclass(slots=True)
class StoreStats:
    hits: dict[str, int]
    misses: int = 0
    dropped: int = 0  # blocks neither tier could take
    ssd_write_failures: int = 0
    ram_evictions: int = 0  # blocks RAM let go to make room (to the SSD, if it took them)
    ssd_evictions: int = 0  # block files the SSD budget deleted


class BlockStore:
    def __init__(
        self,
        ram: RamTier,
        ssd: SsdTier | None = None,
        *,
        write_through: bool = False,
        ssd_retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ram, self.ssd = ram, ssd
        self.write_through = write_through
        self.ssd_retry_s = ssd_retry_s
        self.clock = clock
        self.stats = StoreStats(hits={"ram": 0, "ssd": 0})
        self._ssd_down_until: float | None = None

    @property
    def ssd_degraded(self) -> bool:
        return self._ssd_down_until is not None

    def put(self, key: BlockKey, data: bytes) -> bool:
        """Store a block; False when neither tier could take it (counted as dropped)."""
        try:
            evicted = self.ram.put(key, data)
        except RamFull:
            if self._to_ssd(key, data):
                return True
            self.stats.dropped += 1
            return False
        self.stats.ram_evictions += len(evicted)
        for old_key, old_data in evicted:
            self._to_ssd(old_key, old_data)
        if self.write_through:
            self._to_ssd(key, data)
        return True

    def get(self, key: BlockKey) -> tuple[bytes, Tier] | None:
        data = self.ram.get(key)
        if data is not None:
            self.stats.hits["ram"] += 1
            return data, "ram"
        data = self.ssd.get(key) if self.ssd is not None else None
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits["ssd"] += 1
        try:  # promoted: the next reader finds it in RAM
            evicted = self.ram.put(key, data)
        except RamFull:
            evicted = []
        self.stats.ram_evictions += len(evicted)
        for old_key, old_data in evicted:
            self._to_ssd(old_key, old_data)
        return data, "ssd"

    def lookup(self, keys: Sequence[BlockKey]) -> list[Tier]:
        """The tier of each block of the longest present prefix of `keys`."""
        tiers: list[Tier] = []
        for key in keys:
            if key in self.ram:
                tiers.append("ram")
            elif self.ssd is not None and key in self.ssd:
                tiers.append("ssd")
            else:
                break
        return tiers

    def _to_ssd(self, key: BlockKey, data: bytes) -> bool:
        if self.ssd is None:
            return False
        now = self.clock()
        if self._ssd_down_until is not None and now < self._ssd_down_until:
            return False
        try:
            self.stats.ssd_evictions += len(self.ssd.put(key, data))
        except SsdFull as exc:
            self.stats.ssd_write_failures += 1
            if self._ssd_down_until is None:
                log.warning("ssd tier unavailable (%s): RAM only, retrying in %.0fs", exc,
                            self.ssd_retry_s)  # fmt: skip
            self._ssd_down_until = now + self.ssd_retry_s
            return False
        if self._ssd_down_until is not None:
            log.info("ssd tier writable again")
            self._ssd_down_until = None
        return True
