"""Revoked certificates: a deny-list in etcd that every TLS listener of ours checks.

`cgn-ctl pki revoke NODE` writes one key per certificate of NODE,
`/cognitora/revoked/<serial in lower-case hex>`, with `{"node", "at_unix",
"reason"}`, and deletes NODE's etcd user (so etcd, which does not read our
list, refuses the node too once RBAC is on). Services follow the prefix into
a `RevocationList`; `cgn_core.http.mtls_middleware` refuses a listed
certificate with 403 "certificate revoked" on every management path.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from cgn_core import keys
from cgn_core.etcd.client import EtcdClient
from cgn_core.etcd.follow import list_and_watch
from cgn_core.etcd.types import KeyValue, WatchEvent
from cgn_core.records import RecordError, RecordLog, obj, text

log = logging.getLogger(__name__)

_SERIAL = re.compile(r"^[0-9a-f]{1,40}$")


@dataclass(slots=True)
class RevocationList:
    """Serials (lower-case hex, no leading zeros) of revoked certificates -> the node named."""

    serials: dict[str, str] = field(default_factory=dict)

    def revoked(self, peercert: dict[str, Any] | None) -> str | None:
        """The node a revoked peer certificate was issued to, or None when it is not revoked."""
        serial = (peercert or {}).get("serialNumber")
        if not isinstance(serial, str):
            return None
        return self.serials.get(normal_serial(serial))

    def replace(self, entries: dict[str, str]) -> None:
        self.serials = dict(entries)

    def put(self, serial: str, node: str) -> None:
        self.serials[serial] = node

    def delete(self, serial: str) -> None:
        self.serials.pop(serial, None)


def normal_serial(serial: str | int) -> str:
    """A serial as the deny-list keys it: lower-case hex without leading zeros."""
    value = serial if isinstance(serial, int) else int(serial, 16)
    return format(value, "x")


def serial_of(key: str) -> str:
    """The serial a `/cognitora/revoked/<serial>` key names; RecordError when malformed."""
    serial = key[len(keys.REVOKED) :]
    if not _SERIAL.match(serial):
        raise RecordError(f"{key}: not a certificate serial (lower-case hex)")
    return normal_serial(serial)


def parse_revoked(doc: Any) -> str:
    """A deny-list record: the node the certificate was issued to."""
    return text(obj(doc, "revocation"), "node", required=True)


async def follow_revocations(client: EtcdClient, revoked: RevocationList) -> None:
    """Keep `revoked` equal to `/cognitora/revoked/` for the life of the task."""
    import asyncio

    records = RecordLog(log)

    def entry(kv: KeyValue) -> tuple[str, str] | None:
        try:
            serial = serial_of(kv.key)
        except RecordError as exc:
            log.warning("ignoring %s", exc)
            return None
        node = records.parse(kv.key, kv.mod_revision, kv.value, parse_revoked)
        return None if node is None else (serial, node)

    def on_list(kvs: list[KeyValue]) -> None:
        revoked.replace(dict(e for kv in kvs if (e := entry(kv)) is not None))

    def on_event(ev: WatchEvent) -> None:
        if ev.kind == "delete":
            with contextlib.suppress(RecordError):
                revoked.delete(serial_of(ev.kv.key))
        elif (e := entry(ev.kv)) is not None:
            revoked.put(*e)
            log.warning("certificate %s of node %s revoked", e[0], e[1])

    await list_and_watch(client, keys.REVOKED, on_list, on_event, asyncio.Event())
