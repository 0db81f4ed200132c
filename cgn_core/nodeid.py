"""The node id: given in settings, or derived once from the machine and kept in the state dir.

Derived ids are the host name, lower-cased and reduced to [a-z0-9.-], written
to `<state_dir>/node_id` on first start and read back ever after, so renaming
the host later does not change the node's identity in etcd.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from cgn_core.errors import ConfigError
from cgn_core.files import atomic_write_text

_VALID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def node_id(configured: str, state_dir: Path) -> str:
    if configured:
        if not _VALID.match(configured):
            raise ConfigError(f"node_id {configured!r}: use 1-63 of [A-Za-z0-9._-]")
        return configured
    path = state_dir / "node_id"
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if kept and _VALID.match(kept):
        return kept
    derived = derive_node_id()
    atomic_write_text(path, derived + "\n")
    return derived


def derive_node_id() -> str:
    """A node id from the host name: lower-cased, reduced to [a-z0-9.-], at most 63 characters."""
    slug = re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip("-.")
    return (slug or "node")[:63]


def primary_address() -> str:
    """This machine's address on its default route (no packet is sent), or loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects the outgoing interface
            addr: str = s.getsockname()[0]
            return addr
        except OSError:
            return "127.0.0.1"
