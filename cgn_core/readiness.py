"""Readiness signalling for daemons, so tests and `cgn-ctl up` start real processes without sleeps.

A daemon binds its listeners first (port 0 picks a free port), starts
serving, and only then writes its `--ready-file`: a small JSON document with
its pid and the ports it actually bound. The write is atomic (temp file +
rename), so a reader never sees half a file. A supervisor polls for the file
with `wait_ready_file`, which also fails fast if the process has died.

Under systemd (`Type=notify`), `announce_ready` also sends `READY=1` to
`$NOTIFY_SOCKET` (the sd_notify protocol: one datagram on a unix socket,
`@` meaning the abstract namespace), so units order on real readiness;
`announce_stopping` sends `STOPPING=1` when shutdown begins.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from cgn_core.errors import ConfigError
from cgn_core.files import atomic_write_text

log = logging.getLogger(__name__)


def bind_tcp(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 lets the kernel choose a free one.
    With `reuse_port`, other processes may listen on the same port (SO_REUSEPORT: the
    kernel spreads new connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        # NOTE: a ConfigError, so every daemon says which address in one line (exit 2)
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def write_ready_file(path: Path, **info: Any) -> None:
    """Atomically write {"pid": ..., **info} to `path` (write to a temp file, then rename)."""
    atomic_write_text(path, json.dumps({"pid": os.getpid(), **info}) + "\n")


def sd_notify(message: str) -> bool:
    """Send `message` ("READY=1", "STOPPING=1", "STATUS=...") to systemd; False where no
    $NOTIFY_SOCKET is set (not run by a Type=notify unit) or it cannot be reached."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True


def announce_ready(ready_file: Path | None, status: str, **info: Any) -> None:
    """Serving: write the ready file (when asked for one) and tell systemd (when run by it)."""
    if ready_file is not None:
        write_ready_file(ready_file, **info)
    sd_notify(f"READY=1\nSTATUS={status}")


def announce_stopping() -> None:
    sd_notify("STOPPING=1")


def wait_ready_file(
    path: Path,
    timeout_s: float,
    proc: subprocess.Popen[Any] | None = None,
    poll_s: float = 0.02,
) -> dict[str, Any]:
    """Wait until `path` exists and return its JSON; raise if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            doc: dict[str, Any] = json.loads(path.read_text())
            return doc
        except FileNotFoundError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(poll_s)
