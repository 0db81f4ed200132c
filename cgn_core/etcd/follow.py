"""List a prefix, then follow it: the one way services mirror a part of etcd.

`list_and_watch` retries the first listing with jittered backoff until etcd
answers, hands it to `on_list`, sets `listed`, then feeds every later change
to `on_event` (and a compaction re-listing to `on_list` again). The watch
underneath reconnects on its own, so this runs for the life of its task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from cgn_core.backoff import Backoff
from cgn_core.errors import CognitoraError
from cgn_core.etcd.client import EtcdClient
from cgn_core.etcd.types import KeyValue, WatchEvent

log = logging.getLogger(__name__)
T = TypeVar("T")


async def list_and_watch(
    client: EtcdClient,
    prefix: str,
    on_list: Callable[[list[KeyValue]], None],
    on_event: Callable[[WatchEvent], None],
    listed: asyncio.Event,
) -> None:
    backoff = Backoff(base=0.2, cap=5.0)
    while True:
        try:
            kvs, rev = await client.get_prefix(prefix)
            break
        except CognitoraError as exc:
            delay = backoff.next()
            log.warning("etcd: cannot list %s (%s); retrying in %.1fs", prefix, exc.message, delay)
            await asyncio.sleep(delay)
    _contained(prefix, on_list, kvs)
    listed.set()
    async for batch in client.watch_prefix(prefix, start_revision=rev + 1):
        if batch.resync is not None:
            _contained(prefix, on_list, list(batch.resync))
        for ev in batch.events:
            _contained(ev.kv.key, on_event, ev)


def _contained(where: str, handler: Callable[[T], None], arg: T) -> None:
    """Run one handler; whatever it raises is logged with the key and skipped.

    NOTE: handlers validate their records and should raise nothing; this is the backstop
    that keeps one bad record (or a bug it triggers) from ending the watch, and with it the
    process whose TaskGroup owns it."""
    try:
        handler(arg)
    except Exception:
        log.exception("etcd: the handler for %s failed; skipping this change", where)
