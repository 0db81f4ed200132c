"""The SSD tier: one file per KV block in a directory, under a byte budget, never half-written.

File `<layout hex>-<block hex>.blk`: a 48-byte header (magic `CGNKV2\\0\\0`,
payload length as 8 bytes little-endian, a tag) and the payload. The tag is
BLAKE3 keyed with the store's seal key (cgn_core/kv/identity.py) over the
block's name and payload: a file written by anyone without the key, altered on
disk, or renamed to another block's name fails it and is never served (with no
node secret the key is all zeros: a checksum, not a seal). Block files are
opened without following links and without blocking, and must be regular.

A block is written to a temporary file in the same directory, fsynced, then
renamed into place (and the directory fsynced), so a crash leaves either the
whole block or nothing under its name; leftover temporary files are removed at
start. The index is rebuilt from the directory at start (oldest modification
first, as the LRU order); a file whose header does not match its size is moved
to `quarantine/` then, and one whose payload fails its checksum when read is
moved there and never served. When the disk is full a write fails cleanly
(`SsdFull`), nothing partial is left, and the caller carries on with RAM only.

Tunables: the directory (`--ssd-dir`) and `budget_bytes` (`--ssd-bytes`).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import secrets
import struct
from collections import OrderedDict
from pathlib import Path

from blake3 import blake3

from cgn_core.files import open_regular
from cgn_core.kv.layout import BlockKey, LayoutError

log = logging.getLogger(__name__)

MAGIC = b"CGNKV2\0\0"
HEADER = struct.Struct("<8sQ32s")  # magic, payload length, keyed BLAKE3 of name and payload
UNSEALED = bytes(32)  # the key without a node secret
SUFFIX = ".blk"


class SsdFull(Exception):
    """The block could not be written (no space, or over the budget with nothing to evict)."""


class SsdTier:
    def __init__(self, directory: Path, budget_bytes: int, seal_key: bytes = UNSEALED):
        self.dir = directory
        self._seal_key = seal_key
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.checksum_failures = 0
        self.quarantined = 0
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # key -> file size, LRU first
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def path(self, key: BlockKey) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    # ---- reads ----------------------------------------------------------------------------

    def get(self, key: BlockKey) -> bytes | None:
        """The block's payload, checked against its checksum; None when absent or corrupt."""
        if key not in self._index:
            return None
        try:
            raw = _read_regular(self.path(key), self._index[key])
        except OSError as exc:
            log.warning("ssd tier: cannot read %s (%s); dropping it", key.hex(), exc.strerror)
            self._forget(key)
            return None
        sealed = hmac.compare_digest(raw[: HEADER.size], self._header(key, raw))
        payload = raw[HEADER.size :] if sealed else None
        if payload is None:
            self.checksum_failures += 1
            log.error("ssd tier: block %s failed its integrity tag; quarantined", key.hex())
            self._quarantine(self.path(key))
            self._forget(key)
            return None
        self._index.move_to_end(key)
        return payload

    # ---- writes ---------------------------------------------------------------------------

    def put(self, key: BlockKey, payload: bytes) -> list[BlockKey]:
        """Write the block durably; returns the blocks evicted for it. SsdFull when it cannot."""
        if key in self._index:
            self._index.move_to_end(key)
            return []
        size = HEADER.size + len(payload)
        if size > self.budget_bytes:
            raise SsdFull(f"a {size}-byte block exceeds the SSD budget of {self.budget_bytes}")
        evicted = []
        while self.used_bytes + size > self.budget_bytes and self._index:
            victim = next(iter(self._index))
            with contextlib.suppress(FileNotFoundError):
                self.path(victim).unlink()
            self._forget(victim)
            evicted.append(victim)
        header = self._header(key, payload, offset=0)
        tmp = self.dir / f".tmp-{secrets.token_hex(8)}"
        try:
            with tmp.open("wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
            _fsync_dir(self.dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SsdFull(f"no space left in {self.dir}") from None
            raise SsdFull(f"cannot write to {self.dir}: {exc.strerror}") from None
        self._index[key] = size
        self.used_bytes += size
        return evicted

    def discard(self, key: BlockKey) -> bool:
        if key not in self._index:
            return False
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()
        self._forget(key)
        return True

    def block_keys(self) -> list[BlockKey]:
        return list(self._index)

    def _header(self, key: BlockKey, data: bytes, offset: int = HEADER.size) -> bytes:
        """The header a block file of `key` holding `data[offset:]` as its payload must have."""
        payload = memoryview(data)[offset:]
        tag = blake3(key.layout + key.block, key=self._seal_key)
        tag.update(payload)
        return HEADER.pack(MAGIC, len(payload), tag.digest())

    # ---- start-up -------------------------------------------------------------------------

    def _rebuild(self) -> None:
        found: list[tuple[float, BlockKey, int]] = []
        for path in self.dir.iterdir():
            if path.name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    path.unlink()  # a write that never finished
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                key = BlockKey.from_hex(path.name[: -len(SUFFIX)])
                head, st = _read_head(path)
            except (LayoutError, OSError):
                self._quarantine(path)  # also a link, a FIFO, a device: never opened again
                continue
            if not _header_fits(head, st.st_size):
                self._quarantine(path)
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found, key=lambda f: f[0]):
            self._index[key] = size
            self.used_bytes += size
        if found or self.quarantined:
            log.info(
                "ssd tier: %d blocks (%d bytes) in %s, %d quarantined",
                len(self._index),
                self.used_bytes,
                self.dir,
                self.quarantined,
            )

    def _forget(self, key: BlockKey) -> None:
        self.used_bytes -= self._index.pop(key, 0)

    def _quarantine(self, path: Path) -> None:
        qdir = self.dir / "quarantine"
        with contextlib.suppress(OSError):
            qdir.mkdir(exist_ok=True)
            os.replace(path, qdir / path.name)
        self.quarantined += 1


def _header_fits(head: bytes, file_size: int) -> bool:
    if len(head) != HEADER.size:
        return False
    magic, length, _ = HEADER.unpack(head)
    return bool(magic == MAGIC and HEADER.size + length == file_size)


def _read_head(path: Path) -> tuple[bytes, os.stat_result]:
    fd, st = open_regular(path, follow_links=False)  # NOTE: a FIFO planted here never blocks
    try:
        return os.pread(fd, HEADER.size, 0), st
    finally:
        os.close(fd)


def _read_regular(path: Path, size: int) -> bytes:
    """A block file's bytes: exactly the `size` its index entry says, or OSError."""
    fd, st = open_regular(path, follow_links=False)
    try:
        if st.st_size != size:
            raise OSError(errno.EINVAL, f"size {st.st_size}, expected {size}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(size)
    finally:
        os.close(fd)
    return raw


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
