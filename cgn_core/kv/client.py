"""A blocking client of cgn-kvcached for one layout (what an engine's threads call).

Same node: blocks move through a file in the server's `shm_dir` (a tmpfs), so
a restore costs two memory copies instead of the Python gRPC path (~250 MB/s,
bench/results/kvcached_tiers.md). The client creates the file, the server
reads or writes it, the client removes it; nothing is left behind on success
or on error. Elsewhere, or when the server offers no shared memory, the
bytes ride in the messages.

Every call raises `KvCacheError` on any failure (unreachable server,
timeout, refused request, a token the store does not accept): the caller's
answer to all of them is the same, to recompute. A layout nothing was ever
stored under is not an error: the cache simply holds nothing of it yet.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from cgn_core.kv.identity import bearer
from cgn_core.kv.layout import Layout
from cgn_core.settings import TlsSettings
from cgn_core.tls import channel
from cgn_proto.cognitora.v1 import kv_events_pb2 as ev_pb
from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
TIER_NAMES = {ev_pb.KV_TIER_RAM: "ram", ev_pb.KV_TIER_SSD: "ssd"}
_MAX_MESSAGE = 64 << 20


class KvCacheError(Exception):
    """A call to cgn-kvcached failed; the caller recomputes instead."""


class KvCacheClient:
    def __init__(
        self,
        address: str,
        layout: Layout,
        *,
        tls: TlsSettings | None = None,
        node: str = "",
        token: str = "",
        timeout_s: float = 5.0,
        shared_memory: bool = True,
    ):
        self.address, self.layout, self.timeout_s = address, layout, timeout_s
        # NOTE: a restarted kvcached is found again within a second, not after gRPC's
        # default reconnect backoff (up to two minutes of recomputing everything)
        opts = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._channel = channel(address, tls, opts)
        self._stub = pb_grpc.KvCacheStub(self._channel)
        # NOTE: the node's client token (cgn_core/kv/identity.py) rides every call
        self._meta = ((("x-cgn-node", node),) if node else ()) + ((bearer(token),) if token else ())
        self._pb_layout = pb.KvLayout(
            dtype=layout.dtype,
            layers=layout.layers,
            kv_heads=layout.kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            engine=layout.engine,
        )
        self._want_shm = shared_memory
        self._shm_dir: Path | None = None
        self._probed = False

    def close(self) -> None:
        self._channel.close()

    @property
    def shared_memory(self) -> bool:
        """Whether the last calls moved their bytes through shared memory."""
        return self._shm_dir is not None

    # ---- calls ------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], trace: Mapping[str, str] | None = None) -> list[str]:
        """The tier ("ram" or "ssd") of each block of the longest stored prefix of `hashes`;
        `trace`: a request's `traceparent` (and `tracestate`), sent as call metadata."""
        if not hashes:
            return []
        req = pb.LookupRequest(layout=self._pb_layout, hashes=list(hashes))
        try:
            reply = self._stub.Lookup(req, timeout=self.timeout_s, metadata=self._with(trace))
        except grpc.RpcError as exc:
            raise KvCacheError(_describe(exc)) from None
        return [TIER_NAMES.get(t, "ssd") for t in reply.tiers]

    def get(
        self, hashes: Sequence[bytes], trace: Mapping[str, str] | None = None
    ) -> tuple[np.ndarray, list[str]]:
        """The bytes of the longest stored prefix of `hashes`, [blocks, block bytes] uint8,
        and the tier each block came from (`trace`: as for `lookup`)."""
        if not hashes:
            return np.empty((0, self.layout.block_bytes), np.uint8), []
        bb = self.layout.block_bytes
        shm = self._shm_file(len(hashes) * bb)
        req = pb.GetRequest(
            layout=self._pb_layout, hashes=list(hashes), shm_path=str(shm[0]) if shm else ""
        )
        tiers: list[str] = []
        chunks: list[bytes] = []
        try:
            try:
                meta = self._with(trace)
                for reply in self._stub.Get(req, timeout=self.timeout_s, metadata=meta):
                    pairs = (
                        zip(reply.blocks, reply.tiers, strict=True)
                        if reply.blocks
                        else ((reply.block, reply.tier),)
                    )
                    for block, tier in pairs:
                        if len(tiers) >= len(hashes) or block.hash != hashes[len(tiers)]:
                            raise KvCacheError("the server answered blocks out of order")
                        if shm is None:
                            if len(block.data) != bb:
                                raise KvCacheError("the server sent a block of the wrong size")
                            chunks.append(block.data)
                        tiers.append(TIER_NAMES.get(tier, "ssd"))
            except ValueError:  # zip(strict=True): as many tiers as blocks, or it is not ours
                raise KvCacheError("the server's reply does not pair blocks with tiers") from None
            except grpc.RpcError as exc:
                self._probed = False  # a restarted server may have moved its shm_dir
                raise KvCacheError(_describe(exc)) from None
            if shm is None:
                flat = np.frombuffer(b"".join(chunks), np.uint8)
            elif tiers:
                # NOTE: mapped, not read: the caller's copy into its pool is the only one
                view = mmap.mmap(shm[1], len(tiers) * bb, prot=mmap.PROT_READ)
                flat = np.frombuffer(view, np.uint8)
            else:
                flat = np.empty(0, np.uint8)
        finally:
            _discard(shm)
        return flat.reshape(len(tiers), bb), tiers

    def put(self, hashes: Sequence[bytes], data: np.ndarray) -> int:
        """Offer blocks ([blocks, block bytes] uint8, C-contiguous); returns how many were
        stored (the rest the server had no room for)."""
        if not hashes:
            return 0
        bb = self.layout.block_bytes
        if data.shape != (len(hashes), bb) or data.dtype != np.uint8:
            raise ValueError(
                f"put needs [{len(hashes)}, {bb}] uint8, got {data.shape} {data.dtype}"
            )
        shm = self._shm_file(data.nbytes)
        try:
            if shm is not None:
                _write_all(shm[1], memoryview(np.ascontiguousarray(data).data).cast("B"))
            reply = self._stub.Put(
                self._put_stream(hashes, data, str(shm[0]) if shm else ""),
                timeout=self.timeout_s,
                metadata=self._meta,
            )
        except grpc.RpcError as exc:
            self._probed = False
            raise KvCacheError(_describe(exc)) from None
        except OSError as exc:
            raise KvCacheError(f"shared memory: {exc}") from None
        finally:
            _discard(shm)
        return int(reply.stored)

    def _put_stream(
        self, hashes: Sequence[bytes], data: np.ndarray, path: str
    ) -> Iterator[pb.PutRequest]:
        """Many blocks per message: ~4 MiB of bytes inline, or every block over shared memory
        (then a block is a hash and an offset)."""
        bb = self.layout.block_bytes
        per = len(hashes) if path else max(1, (4 << 20) // bb)
        for first in range(0, len(hashes), per):
            if path:
                blocks = [
                    pb.KvBlock(hash=h, shm_offset=(first + i) * bb)
                    for i, h in enumerate(hashes[first : first + per])
                ]
            else:
                blocks = [
                    pb.KvBlock(hash=h, data=data[first + i].tobytes())
                    for i, h in enumerate(hashes[first : first + per])
                ]
            if first == 0:
                yield pb.PutRequest(layout=self._pb_layout, shm_path=path, blocks=blocks)
            else:
                yield pb.PutRequest(blocks=blocks)

    # ---- shared memory ----------------------------------------------------------------------

    def _shm_file(self, size: int) -> tuple[Path, int] | None:
        """A fresh file of `size` bytes in the server's shm_dir, or None: use the messages."""
        if not self._probed:
            self._probe()
        if self._shm_dir is None:
            return None
        try:
            fd, name = tempfile.mkstemp(prefix=f"c{os.getpid()}-", suffix=".kv", dir=self._shm_dir)
        except OSError as exc:
            log.warning("shared memory with %s off: %s", self.address, exc)
            self._shm_dir = None
            return None
        try:
            os.ftruncate(fd, size)
        except OSError:
            _discard((Path(name), fd))
            return None
        return Path(name), fd

    def _with(self, trace: Mapping[str, str] | None) -> Any:
        """The call's metadata: the token, and a request's trace context when given."""
        return (*self._meta, *trace.items()) if trace else self._meta

    def _probe(self) -> None:
        """Ask the server where its shared-memory directory is; use it if this host has it."""
        self._probed = True
        self._shm_dir = None
        if not self._want_shm:
            return
        try:
            stats = self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s, metadata=self._meta)
        except grpc.RpcError as exc:
            self._probed = False  # try again on the next call
            raise KvCacheError(_describe(exc)) from None
        path = Path(stats.shm_dir) if stats.shm_dir else None
        if path is not None and path.is_dir() and os.access(path, os.W_OK):
            self._shm_dir = path


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def _discard(shm: tuple[Path, int] | None) -> None:
    if shm is None:
        return
    path, fd = shm
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code()
    return f"{code.name if code else 'error'}: {exc.details() or ''}".strip()
