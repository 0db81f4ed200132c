"""RDMA ports (InfiniBand, or RoCE when the link layer is Ethernet) from /sys/class/infiniband,
and the interface that holds an address (the management network multi-node ranks bootstrap on).

Layout read: <root>/<device>/ports/<n>/{state, rate, link_layer}, where state
reads "4: ACTIVE" and rate "400 Gb/sec (4X NDR)". An IPv4 address's interface comes from
the SIOCGIFADDR ioctl on each interface, an IPv6 one's from /proc/net/if_inet6.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import re
import socket
import struct
from pathlib import Path

from cgn_agent.inventory.types import NetLink

SYSFS_ROOT = Path("/sys/class/infiniband")


def rdma_links(root: Path = SYSFS_ROOT) -> list[NetLink]:
    links: list[NetLink] = []
    if not root.is_dir():
        return links
    for dev in sorted(root.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: int(p.name)):
            state = _read(port / "state").partition(":")[2].strip() or "unknown"
            rate = re.match(r"\s*([\d.]+)\s*Gb/sec", _read(port / "rate"))
            links.append(
                NetLink(
                    dev.name,
                    int(port.name),
                    state,
                    float(rate.group(1)) if rate else None,
                    _read(port / "link_layer") or "InfiniBand",
                )
            )
    return links


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


SIOCGIFADDR = 0x8915


def iface_of(address: str, inet6: Path = Path("/proc/net/if_inet6")) -> str:
    """The name of the interface holding `address` (an IP literal); "" when none does."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return ""
    if ip.version == 6:
        with contextlib.suppress(OSError):
            for line in inet6.read_text().splitlines():
                fields = line.split()
                if len(fields) == 6 and ipaddress.ip_address(_v6(fields[0])) == ip:
                    return fields[5]
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                if socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24]) == str(ip):
                    return name
    return ""


def _v6(hex32: str) -> str:
    return ":".join(hex32[i : i + 4] for i in range(0, 32, 4))
