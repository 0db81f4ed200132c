"""RDMA ports (InfiniBand, or RoCE when the link layer is Ethernet) from /sys/class/infiniband.

Layout read: <root>/<device>/ports/<n>/{state, rate, link_layer}, where state
reads "4: ACTIVE" and rate "400 Gb/sec (4X NDR)".
"""

from __future__ import annotations

import re
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
