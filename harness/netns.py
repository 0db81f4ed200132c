"""A second "host" on this machine: a network namespace joined to this one by a veth pair.

Needs root and iproute2; `NetnsUnavailable` says why not, so that a test can
skip with the reason. The addresses are in 198.18.0.0/15 (RFC 2544's
benchmarking range, routed nowhere). A namespace shares the filesystem with
this one (so /dev/shm too): a transfer meant to cross the pair must not use
shared memory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


class NetnsUnavailable(Exception):
    """No namespace could be made here; the message says why."""


@contextmanager
def other_host() -> Iterator[tuple[str, str, str]]:
    """Yields (namespace, its address, this side's address); everything is removed after."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NetnsUnavailable("needs root and iproute2 to make a network namespace")
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"cgn-ns-{tag}", f"cgnh{tag}", f"cgnp{tag}"
    net = f"198.18.{int(tag[:2], 16)}"

    def ip(*args: str, check: bool = True) -> None:
        subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)

    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        why = exc.stderr.decode().strip()
        raise NetnsUnavailable(f"cannot make a network namespace: {why}") from None
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", f"{net}.1/24", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns, f"{net}.2", f"{net}.1"
    finally:
        ip("link", "del", here, check=False)
        ip("netns", "del", ns, check=False)
