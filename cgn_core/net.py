"""Addresses read from configuration, records and peers: what they may be, checked in one place."""

from __future__ import annotations

import ipaddress
from typing import Any


def is_host_port(value: Any) -> bool:
    """Whether `value` is an address `host:port` with a port in 1..65535."""
    if not isinstance(value, str) or len(value) > 260:
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def is_loopback(remote: str | None) -> bool:
    """Whether a peer address (an IP, no port) is a loopback one."""
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def is_ip(value: Any) -> bool:
    """Whether `value` is an IPv4 or IPv6 address literal."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return isinstance(value, str)
