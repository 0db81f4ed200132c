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
* Every change of what a tier holds is recorded as a KV event (stored or
  removed, with the tier), for routers; `drain_events` hands them over in
  order, numbered without gaps.
* `discard` (admin eviction) drops a block from both tiers.

The gRPC service (service.py) is the shell around this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from cgn_core.kv.blockhash import BlockHash
from cgn_core.kv.events import KvEvent
from cgn_core.kv.events import Tier as EventTier
from cgn_core.kv.layout import BlockKey
from cgn_core.kv.ram_tier import RamFull, RamTier
from cgn_core.kv.ssd_tier import SsdFull, SsdTier

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
        # runs of changes not drained yet: (kind, tier, hashes), one event each when drained
        self._runs: list[tuple[Literal["stored", "removed"], EventTier, list[BlockHash]]] = []
        self._seq = 0

    @property
    def ssd_degraded(self) -> bool:
        return self._ssd_down_until is not None

    def put(self, key: BlockKey, data: bytes) -> bool:
        """Store a block; False when neither tier could take it (counted as dropped)."""
        if not self._to_ram(key, data):
            if self._to_ssd(key, data):
                return True
            self.stats.dropped += 1
            return False
        if self.write_through:
            self._to_ssd(key, data)
        return True

    def discard(self, key: BlockKey) -> bool:
        """Drop a block from both tiers (pinned RAM copies stay); whether anything went."""
        in_ram = self.ram.discard(key) is not None
        on_ssd = self.ssd.discard(key) if self.ssd is not None else False
        if in_ram:
            self._note("removed", "ram", key)
        if on_ssd:
            self._note("removed", "ssd", key)
        return in_ram or on_ssd

    def drain_events(self) -> list[KvEvent]:
        runs, self._runs = self._runs, []
        events = []
        for kind, tier, hashes in runs:
            self._seq += 1
            events.append(KvEvent(self._seq, kind, tuple(hashes), tier))
        return events

    def held(self) -> dict[EventTier, list[bytes]]:
        """The block hashes each tier holds (what an event subscriber starts from)."""
        out: dict[EventTier, list[bytes]] = {"ram": [k.block for k in self.ram.block_keys()]}
        out["ssd"] = [k.block for k in self.ssd.block_keys()] if self.ssd is not None else []
        return out

    def _to_ram(self, key: BlockKey, data: bytes) -> bool:
        """Into RAM, what it evicts to the SSD (write-behind); False when RAM is full."""
        new = key not in self.ram
        try:
            evicted = self.ram.put(key, data)
        except RamFull:
            return False
        if new:
            self._note("stored", "ram", key)
        self.stats.ram_evictions += len(evicted)
        for old_key, old_data in evicted:
            self._note("removed", "ram", old_key)
            self._to_ssd(old_key, old_data)
        return True

    def _note(
        self, kind: Literal["stored", "removed"], tier: Literal["ram", "ssd"], key: BlockKey
    ) -> None:
        if self._runs and self._runs[-1][:2] == (kind, tier):  # one event per run
            self._runs[-1][2].append(BlockHash(key.block))
        else:
            self._runs.append((kind, tier, [BlockHash(key.block)]))

    def get(self, key: BlockKey) -> tuple[bytes, Tier] | None:
        data = self.ram.get(key)
        if data is not None:
            self.stats.hits["ram"] += 1
            return data, "ram"
        on_ssd = self.ssd is not None and key in self.ssd
        data = self.ssd.get(key) if self.ssd is not None else None
        if data is None:
            if on_ssd:  # unreadable or corrupt: the tier dropped it
                self._note("removed", "ssd", key)
            self.stats.misses += 1
            return None
        self.stats.hits["ssd"] += 1
        self._to_ram(key, data)  # promoted: the next reader finds it in RAM
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
        new = key not in self.ssd
        try:
            evicted = self.ssd.put(key, data)
        except SsdFull as exc:
            self.stats.ssd_write_failures += 1
            if self._ssd_down_until is None:
                log.warning(
                    "ssd tier unavailable (%s): RAM only, retrying in %.0fs", exc, self.ssd_retry_s
                )
            self._ssd_down_until = now + self.ssd_retry_s
            return False
        self.stats.ssd_evictions += len(evicted)
        for old in evicted:
            self._note("removed", "ssd", old)
        if new:
            self._note("stored", "ssd", key)
        if self._ssd_down_until is not None:
            log.info("ssd tier writable again")
            self._ssd_down_until = None
        return True
