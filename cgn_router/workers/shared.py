"""What the router's worker processes count together (`--workers`, workers.py): a key's
usage against its limits, the requests each worker has in flight on each endpoint, and
what each learned of each endpoint's speed.

Each is a table in one anonymous shared-memory file (memfd) that the supervisor
creates and every worker inherits: fixed-size slots found by open addressing on
a 16-byte digest of their name (an API key id, an endpoint id), each

    digest (16 B) | shared fields | one column per worker

A zeroed slot is a fresh one. Claiming a slot, and a key's usage (read, decide,
write), hold an fcntl lock on the file for a few microseconds: the kernel drops
it when its holder dies, so a worker killed mid-update cannot wedge the others.
A holder that is stopped instead (SIGSTOP, a debugger, a frozen cgroup) keeps
it, so the lock is never waited for on the event loop: it is tried for at most
`LOCK_WAIT_S`, and past that the table is `Busy`, the caller counts alone (its
own view of the key, as when the table is full), the holder is logged by pid,
and for `BUSY_S` no one here tries again (the supervisor replaces a worker
whose loop stops within its heartbeat bound, workers.py, which frees the lock).
Each worker writes only its own column (8-byte aligned: read whole by others
without a lock; a wider one, a speed fit's, under a sequence number: SharedSpeed),
zeroed when it starts, so a killed worker's requests in flight
are not counted forever. Times are CLOCK_MONOTONIC, the same in every process.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)
LOCK_WAIT_S = 0.005  # the most a worker's loop waits for the table's lock
LOCK_POLL_S = 0.0002
BUSY_S = 1.0  # after a wait that ran out: count alone this long without trying
_FLOCK = struct.Struct("hhqqii")  # struct flock on Linux (padded to its 32 bytes)


class Busy(Exception):
    """The table's lock is held past LOCK_WAIT_S: the caller counts alone."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A table's shape: its slots, the fields all workers share, each worker's column."""

    name: str
    slots: int
    shared: struct.Struct  # after the digest
    column: struct.Struct  # per worker

    def slot_size(self, workers: int) -> int:
        return 16 + self.shared.size + self.column.size * workers


USAGE = Layout("usage", 16384, struct.Struct("=4d"), struct.Struct("=q"))
LOAD = Layout("load", 65536, struct.Struct(""), struct.Struct("=qq"))
SPEED_FIELDS = 17  # routing/speed.py's STATE_FIELDS: a fit's decay time, counts and sums
SPEED = Layout("speed", 16384, struct.Struct(""), struct.Struct(f"=q{SPEED_FIELDS}d"))


def create(layout: Layout, workers: int) -> int:
    """A new zeroed table for `workers` workers: its file descriptor (inheritable)."""
    fd = os.memfd_create(f"cgn-router-{layout.name}", 0)
    os.ftruncate(fd, layout.slots * layout.slot_size(workers))
    os.set_inheritable(fd, True)
    return fd


class Table:
    """Worker `worker`'s view of the table in `fd`."""

    def __init__(self, layout: Layout, fd: int, workers: int, worker: int):
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} of {workers}")
        self.layout, self.fd, self.workers, self.worker = layout, fd, workers, worker
        self.size = layout.slot_size(workers)
        self.mem = mmap.mmap(fd, layout.slots * self.size, mmap.MAP_SHARED)
        self.columns_at = 16 + layout.shared.size  # where the workers' columns begin in a slot
        self._own = self.columns_at + layout.column.size * worker
        self._found: dict[str, int | None] = {}  # name -> its slot's offset
        self._full_warned = False
        self._busy_until = 0.0
        zero = bytes(layout.column.size)
        # NOTE: a worker's own column is written by it alone: no lock (a stopped holder must
        # not keep a restarted worker from starting)
        for at in range(self._own, layout.slots * self.size, self.size):
            if self.mem[at : at + len(zero)] != zero:
                self.mem[at : at + len(zero)] = zero

    def acquire(self) -> bool:
        """Take the table's lock within LOCK_WAIT_S (True), or report its holder (False)."""
        now = time.monotonic()
        if now < self._busy_until:
            return False
        deadline = now + LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                break
            time.sleep(LOCK_POLL_S)
        self._busy_until = time.monotonic() + BUSY_S
        log.warning(
            "shared %s table: its lock is held past %.0f ms (by pid %s, stopped?); counting "
            "alone for %.0f s",
            self.layout.name,
            LOCK_WAIT_S * 1000,
            self.holder() or "unknown",
            BUSY_S,
        )
        return False

    def release(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The table's lock for the block; Busy when it cannot be had within LOCK_WAIT_S."""
        if not self.acquire():
            raise Busy
        try:
            yield
        finally:
            self.release()

    def holder(self) -> int | None:
        """The pid holding the table's lock (None: none, or it cannot be told)."""
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0, 0)
        try:
            kind, _, _, _, pid, _ = _FLOCK.unpack(fcntl.fcntl(self.fd, fcntl.F_GETLK, query))
        except OSError:
            return None
        return pid if kind != fcntl.F_UNLCK and pid > 0 else None

    def slot(self, name: str) -> int | None:
        """The offset of `name`'s slot, claimed if new (under the lock, once per name and
        worker); None when the table is full (the caller counts alone, and it is logged) or
        Busy (the caller counts alone, and the next call tries again)."""
        if name in self._found:
            return self._found[name]
        digest = hashlib.blake2b(name.encode(), digest_size=16).digest()
        slots, empty = self.layout.slots, bytes(16)
        start = int.from_bytes(digest[:4], "little") % slots
        found = None
        try:
            with self.locked():
                for probe in range(slots):
                    at = ((start + probe) % slots) * self.size
                    held = self.mem[at : at + 16]
                    if held == empty:
                        self.mem[at : at + 16] = digest
                    if held in (digest, empty):
                        found = at
                        break
        except Busy:
            return None
        if found is None and not self._full_warned:
            self._full_warned = True
            name, n = self.layout.name, slots
            log.warning("shared %s table full (%d): new names count per worker", name, n)
        self._found[name] = found
        return found

    def shared(self, at: int) -> tuple[float, ...]:
        return self.layout.shared.unpack_from(self.mem, at + 16)

    def set_shared(self, at: int, *values: float) -> None:
        self.layout.shared.pack_into(self.mem, at + 16, *values)

    def own(self, at: int) -> tuple[int, ...]:
        return self.layout.column.unpack_from(self.mem, at + self._own)

    def set_own(self, at: int, *values: int) -> None:
        self.layout.column.pack_into(self.mem, at + self._own, *values)

    def column_at(self, at: int, worker: int) -> int:
        """The offset of `worker`'s column in the slot at `at`."""
        return at + self.columns_at + self.layout.column.size * worker

    def columns(self, at: int) -> list[tuple[int, ...]]:
        """Every worker's column, this one's too, in worker order."""
        col, first = self.layout.column, at + self.columns_at
        return [col.unpack_from(self.mem, first + col.size * w) for w in range(self.workers)]

    def others(self, at: int) -> list[int]:
        """The other workers' columns, added field by field."""
        total = [0] * len(self.layout.column.format.lstrip("="))
        for w, column in enumerate(self.columns(at)):
            if w != self.worker:
                for i, v in enumerate(column):
                    total[i] += v
        return total

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


class SharedUsage:
    """API keys' usage against their limits (auth.Limiter), counted once for all workers."""

    def __init__(self, fd: int, workers: int, worker: int):
        self.table = Table(USAGE, fd, workers, worker)

    @contextmanager
    def use(self, key_id: str) -> Iterator[Slot | None]:
        """The key's usage, locked for the block; what the block changes is stored after
        (also when it raises: a refusal's refund counts). None: the table is full or busy
        (the caller counts alone)."""
        t = self.table
        at = t.slot(key_id)
        if at is None or not t.acquire():
            yield None
            return
        try:
            theirs = t.others(at)[0]
            rl, ra, tl, ta = t.shared(at)
            slot = Slot(rl, ra, tl, ta, int(t.own(at)[0]) + theirs)
            try:
                yield slot
            finally:
                levels = (slot.requests_level, slot.requests_at, slot.tokens_level, slot.tokens_at)
                t.set_shared(at, *levels)
                t.set_own(at, max(0, slot.in_flight - theirs))
        finally:
            t.release()

    def close(self) -> None:
        self.table.close()


ADMITTED = "\0admitted:"  # a pool's slot name (no endpoint id starts with a NUL)
TAG = "\0tag:"  # an admission band's virtual time, or a tenant's finish tag in one
HEAD = "\0head:"  # the earliest start of the heads a worker has waiting in a band and pool
MILLI = 1000.0  # tags are kept in thousandths of a token (int64: 9e15 tokens)
HEAD_FRESH_S = 1.0  # a head published longer ago is not deferred to (its worker is stuck)


class SharedLoad:
    """Each endpoint's requests in flight and uncached prompt tokens pending, per worker,
    so every worker's load scorer sees all of the router's requests (registry.py); and each
    pool's requests admitted and not finished, per worker, so every worker's admission
    holds the pool's ceiling for the router as a whole (gate.py)."""

    def __init__(self, fd: int, workers: int, worker: int):
        self.table = Table(LOAD, fd, workers, worker)

    def publish(self, eid: str, in_flight: int, pending_prefill: int) -> None:
        at = self.table.slot(eid)
        if at is not None:
            self.table.set_own(at, in_flight, pending_prefill)

    def others(self, eid: str) -> tuple[int, int]:
        """(requests in flight, prefill tokens pending) of the other workers on `eid`."""
        at = self.table.slot(eid)
        if at is None:
            return 0, 0
        in_flight, pending = self.table.others(at)
        return in_flight, pending

    def close(self) -> None:
        self.table.close()

    def tag(self, name: str) -> float:
        """An admission tag (`name`: band, or band and tenant), the largest any worker has
        written: tags only grow, so the largest is the latest."""
        at = self.table.slot(TAG + name)
        if at is None:
            return 0.0
        return max(c[0] for c in self.table.columns(at)) / MILLI

    def set_tag(self, name: str, value: float) -> None:
        at = self.table.slot(TAG + name)
        if at is not None:
            self.table.set_own(at, int(value * MILLI), 0)

    def publish_head(self, where: str, start: float | None, tenant: int = 0) -> None:
        """This worker's earliest waiting start in `where` (band and pool), and its tenant's
        16-bit tag (admission.tenant_tag); None: none. The tag rides in the low bits of the
        time it was published."""
        at = self.table.slot(HEAD + where)
        if at is not None:
            now_ms = int(time.monotonic() * 1000) or 1  # 0 means none
            stamp = now_ms << 16 | tenant & 0xFFFF
            self.table.set_own(at, *((0, 0) if start is None else (int(start * MILLI), stamp)))

    def earliest_head(self, where: str) -> tuple[float, int] | None:
        """The earliest start the other workers published for `where` within HEAD_FRESH_S,
        with its tenant's tag."""
        at = self.table.slot(HEAD + where)
        if at is None:
            return None
        oldest = int((time.monotonic() - HEAD_FRESH_S) * 1000)
        heads = [
            (start / MILLI, stamp & 0xFFFF)
            for w, (start, stamp) in enumerate(self.table.columns(at))
            if w != self.table.worker and stamp and stamp >> 16 >= oldest
        ]
        return min(heads, default=None)

    def publish_admitted(self, pool: str, admitted: int) -> None:
        self.publish(ADMITTED + pool, admitted, 0)

    def admitted_elsewhere(self, pool: str) -> int:
        """The requests the other workers have admitted to `pool` and not finished."""
        return self.others(ADMITTED + pool)[0]


_SEQ = struct.Struct("=q")
_FIT = struct.Struct(f"={SPEED_FIELDS}d")
READ_TRIES = 4  # a column found mid-write this many times is left out of this read


class SharedSpeed:
    """Each endpoint's speed fit (routing/speed.py) as each worker learned it from the
    answers it saw, so that every worker fits every worker's samples and predicts alike
    (registry.py). A worker writes its column under a sequence number, odd while it
    writes; a reader that finds it odd, or changed when it has read, reads again, and past
    READ_TRIES leaves that worker's samples out until its next read."""

    def __init__(self, fd: int, workers: int, worker: int):
        self.table = Table(SPEED, fd, workers, worker)
        self._seq: dict[int, int] = {}  # slot -> the sequence number this worker wrote

    def publish(self, eid: str, state: tuple[float, ...]) -> None:
        """This worker's fit of `eid` (zeros: it has none, as when the endpoint went)."""
        at = self.table.slot(eid)
        if at is None or len(state) != SPEED_FIELDS:
            return
        mine = self.table.column_at(at, self.table.worker)
        seq = self._seq.get(at, 0) + 1
        _SEQ.pack_into(self.table.mem, mine, seq)
        _FIT.pack_into(self.table.mem, mine + _SEQ.size, *state)
        self._seq[at] = seq + 1
        _SEQ.pack_into(self.table.mem, mine, seq + 1)

    def forget(self, eid: str) -> None:
        self.publish(eid, (0.0,) * SPEED_FIELDS)

    def others(self, eid: str) -> list[tuple[float, ...]]:
        """The other workers' fits of `eid` (those that have learned something)."""
        at = self.table.slot(eid)
        if at is None:
            return []
        out = []
        for w in range(self.table.workers):
            if w == self.table.worker:
                continue
            column = self.table.column_at(at, w)
            for _ in range(READ_TRIES):
                (before,) = _SEQ.unpack_from(self.table.mem, column)
                if before % 2:
                    continue
                fit = _FIT.unpack_from(self.table.mem, column + _SEQ.size)
                if _SEQ.unpack_from(self.table.mem, column)[0] == before:
                    if fit[1] > 0:  # its count of samples
                        out.append(fit)
                    break
        return out

    def close(self) -> None:
        self.table.close()
