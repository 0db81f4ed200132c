"""Prefix watches that survive reconnects without losing or repeating an event.

Algorithm: remember `next_rev`, one past the last revision delivered (or
confirmed by a progress notification). On any stream failure, wait a
jittered backoff and re-create the watch at `next_rev` on the next endpoint;
etcd replays everything from there. If `next_rev` has been compacted away,
etcd cancels the watch with `compact_revision` set: we re-list the prefix
and deliver it as one `resync` batch, then watch on from the listing's
revision + 1.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc.aio

from cgn_core.backoff import Backoff
from cgn_core.errors import EtcdUnavailable
from cgn_core.etcd.types import KeyValue, WatchBatch, WatchEvent, prefix_end
from cgn_proto.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc

if TYPE_CHECKING:
    from cgn_core.etcd.client import EtcdClient

log = logging.getLogger(__name__)


async def watch_prefix(
    client: EtcdClient, prefix: str, start_revision: int = 0
) -> AsyncIterator[WatchBatch]:
    """Yield every change under `prefix` from `start_revision` on (0: changes after now)."""
    from cgn_core.etcd.client import EtcdError, is_unavailable

    key = prefix.encode("utf-8", "surrogateescape")
    next_rev = start_revision or (await client.revision()) + 1
    backoff = Backoff(base=0.05, cap=2.0)
    while True:
        create = rpc_pb2.WatchCreateRequest(
            key=key, range_end=prefix_end(key), start_revision=next_rev, progress_notify=True
        )
        call = rpc_pb2_grpc.WatchStub(client.channel()).Watch()
        try:
            await call.write(rpc_pb2.WatchRequest(create_request=create))
            async for resp in call:
                if resp.compact_revision:
                    log.info("watch %s: revision %d compacted, re-listing", prefix, next_rev)
                    kvs, rev = await client.get_prefix(prefix)
                    yield WatchBatch(revision=rev, resync=tuple(kvs))
                    next_rev = rev + 1
                    break  # re-create the watch from the listing
                if resp.canceled:
                    raise EtcdError(f"etcd cancelled the watch on {prefix}: {resp.cancel_reason}")
                backoff.reset()
                if resp.events:
                    events = tuple(_event(e) for e in resp.events)
                    next_rev = events[-1].kv.mod_revision + 1
                    yield WatchBatch(revision=events[-1].kv.mod_revision, events=events)
                elif not resp.created:
                    # Progress notification: nothing under the prefix up to this revision.
                    next_rev = max(next_rev, resp.header.revision + 1)
            else:
                log.warning("watch %s: stream ended by etcd, reconnecting", prefix)
                await asyncio.sleep(backoff.next())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, EtcdUnavailable) as exc:
            if isinstance(exc, grpc.aio.AioRpcError) and not (
                is_unavailable(exc) or exc.code() == grpc.StatusCode.CANCELLED
            ):
                raise
            client.rotate()
            delay = backoff.next()
            log.warning("watch %s: %s; retrying in %.2fs", prefix, _why(exc), delay)
            await asyncio.sleep(delay)
        finally:
            call.cancel()


def _why(exc: Exception) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def _event(e: kv_pb2.Event) -> WatchEvent:
    if e.type == kv_pb2.Event.DELETE:
        return WatchEvent(kind="delete", kv=KeyValue.from_pb(e.kv))
    return WatchEvent(kind="put", kv=KeyValue.from_pb(e.kv))
