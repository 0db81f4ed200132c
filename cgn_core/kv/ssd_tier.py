"""The SSD tier: one file per KV block in a directory, under a byte budget, never half-written.

File `<layout hex>-<block hex>.blk`: a 48-byte header (magic `CGNKV1\\0\\0`,
payload length as 8 bytes little-endian, BLAKE3 of the payload) and the
payload. A block is written to a temporary file in the same directory,
fsynced, then renamed into place (and the directory fsynced), so a crash
leaves either the whole block or nothing under its name; leftover temporary
files are removed at start. The index is rebuilt from the directory at start
(oldest modification first, as the LRU order); a file whose header does not
match its size is moved to `quarantine/` then, and one whose payload fails
its checksum when read is moved there and never served. When the disk is
full a write fails cleanly (`SsdFull`), nothing partial is left, and the
caller carries on with RAM only.

Tunables: the directory (`--ssd-dir`) and `budget_bytes` (`--ssd-bytes`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import struct
from collections import OrderedDict
from pathlib import Path

from blake3 import blake3

from cgn_core.kv.layout import BlockKey, LayoutError

log = logging.getLogger(__name__)

MAGIC = b"CGNKV1\0\0"
HEADER = struct.Struct("<8sQ32s")  # magic, payload length, BLAKE3 of the payload
SUFFIX = ".blk"


class SsdFull(Exception):
    """The block could not be written (no space, or over the budget with nothing to evict)."""


class SsdTier:
    def __init__(self, directory: Path, budget_bytes: int):
        self.dir = directory
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
            raw = self.path(key).read_bytes()
        except OSError as exc:
            log.warning("ssd tier: cannot read %s (%s); dropping it", key.hex(), exc.strerror)
            self._forget(key)
            return None
        payload = _payload(raw)
        if payload is None:
            self.checksum_failures += 1
            log.error("ssd tier: block %s failed its checksum; quarantined", key.hex())
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
        header = HEADER.pack(MAGIC, len(payload), blake3(payload).digest())
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

    # ---- start-up -------------------------------------------------------------------------

    def _rebuild(self) -> None:
        found: list[tuple[float, BlockKey, int]] = []
        for path in self.dir.iterdir():
            if path.name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    path.unlink()  # a write that never finished
                continue
            if not path.name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                key = BlockKey.from_hex(path.name[: -len(SUFFIX)])
                st = path.stat()
                with path.open("rb") as f:
                    head = f.read(HEADER.size)
            except (LayoutError, OSError):
                self._quarantine(path)
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


def _payload(raw: bytes) -> bytes | None:
    """The payload of a block file, or None when its header or checksum is wrong."""
    if not _header_fits(raw[: HEADER.size], len(raw)):
        return None
    _, _, digest = HEADER.unpack(raw[: HEADER.size])
    payload = raw[HEADER.size :]
    return payload if blake3(payload).digest() == digest else None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
