"""Per-key usage shared by the router's worker processes, so a key's limits are counted
once per router, not once per worker.

One anonymous shared-memory file (memfd) created by the supervisor and inherited
by every worker holds a table of fixed-size slots, one per API key, found by
open addressing on a digest of the key id:

    digest (16 B) | requests level, at | tokens level, at (4 doubles) | in flight per worker

A zeroed slot is a fresh key (`Bucket.at == 0` fills the bucket). Every use
holds an fcntl lock on the file for a few microseconds: the kernel drops it when
its holder dies, so a worker killed mid-update cannot wedge the others, and each
worker counts its requests in flight in a column of its own, zeroed when it
starts, so a killed worker's requests are not held against the key forever.
Times are CLOCK_MONOTONIC, the same clock in every process.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

SLOTS = 16384  # distinct keys one router can count across workers
_HEAD = struct.Struct("=16s4d")


def slot_size(workers: int) -> int:
    return _HEAD.size + 4 * workers


def create(workers: int) -> int:
    """A new zeroed table for `workers` workers: its file descriptor (inheritable)."""
    fd = os.memfd_create("cgn-router-usage", 0)
    os.ftruncate(fd, SLOTS * slot_size(workers))
    os.set_inheritable(fd, True)
    return fd


class SharedUsage:
    """Worker `worker`'s view of the table in `fd`."""

    def __init__(self, fd: int, workers: int, worker: int):
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} of {workers}")
        self.fd, self.workers, self.worker = fd, workers, worker
        self.size = slot_size(workers)
        self.mem = mmap.mmap(fd, SLOTS * self.size, mmap.MAP_SHARED)
        self._full_warned = False
        self._forget_own()

    def _forget_own(self) -> None:
        """Zero this worker's in-flight column (a restarted worker's old requests are gone)."""
        column = _HEAD.size + 4 * self.worker
        with self._locked():
            for slot in range(SLOTS):
                at = slot * self.size + column
                if self.mem[at : at + 4] != b"\0\0\0\0":
                    self.mem[at : at + 4] = b"\0\0\0\0"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def _find(self, digest: bytes) -> int | None:
        """The offset of `digest`'s slot, claimed if new; None when the table is full."""
        start = int.from_bytes(digest[:4], "little") % SLOTS
        for probe in range(SLOTS):
            at = ((start + probe) % SLOTS) * self.size
            held = self.mem[at : at + 16]
            if held == digest:
                return at
            if held == bytes(16):
                self.mem[at : at + 16] = digest
                return at
        return None

    @contextmanager
    def use(self, key_id: str) -> Iterator[Slot | None]:
        """The key's slot, locked for the block; what the block changes is stored after.
        None when the table is full (the caller counts the key in this worker alone)."""
        digest = hashlib.blake2b(key_id.encode(), digest_size=16).digest()
        with self._locked():
            at = self._find(digest)
            if at is None:
                if not self._full_warned:
                    self._full_warned = True
                    log.warning("shared key table full (%d keys): new keys count per worker", SLOTS)
                yield None
                return
            _, rl, ra, tl, ta = _HEAD.unpack_from(self.mem, at)
            counts = struct.unpack_from(f"={self.workers}i", self.mem, at + _HEAD.size)
            slot = Slot(rl, ra, tl, ta, sum(counts))
            yield slot
            levels = (slot.requests_level, slot.requests_at, slot.tokens_level, slot.tokens_at)
            _HEAD.pack_into(self.mem, at, digest, *levels)
            mine = counts[self.worker] + slot.in_flight - sum(counts)
            struct.pack_into("=i", self.mem, at + _HEAD.size + 4 * self.worker, max(0, mine))

    def close(self) -> None:
        self.mem.close()


@dataclass(slots=True)
class Slot:
    """One key's token buckets (level and last refill) and its requests in flight in all
    workers; a change to `in_flight` is this worker's."""

    requests_level: float
    requests_at: float
    tokens_level: float
    tokens_at: float
    in_flight: int
