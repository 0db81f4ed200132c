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

from cgn_core.backoff import Backoff
from cgn_core.errors import CognitoraError
from cgn_core.etcd.client import EtcdClient
from cgn_core.etcd.types import KeyValue, WatchEvent

log = logging.getLogger(__name__)


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
    on_list(kvs)
    listed.set()
    async for batch in client.watch_prefix(prefix, start_revision=rev + 1):
        if batch.resync is not None:
            on_list(list(batch.resync))
        for ev in batch.events:
            on_event(ev)
