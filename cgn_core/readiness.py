"""Readiness signalling for daemons, so tests and `cgn-ctl up` start real processes without sleeps.

A daemon binds its listeners first (port 0 picks a free port), starts
serving, and only then writes its `--ready-file`: a small JSON document with
its pid and the ports it actually bound. The write is atomic (temp file +
rename), so a reader never sees half a file. A supervisor polls for the file
with `wait_ready_file`, which also fails fast if the process has died.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from cgn_core.files import atomic_write_text


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 lets the kernel choose a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def write_ready_file(path: Path, **info: Any) -> None:
    """Atomically write {"pid": ..., **info} to `path` (write to a temp file, then rename)."""
    atomic_write_text(path, json.dumps({"pid": os.getpid(), **info}) + "\n")


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
