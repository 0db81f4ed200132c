"""Child processes in their own process group, stopped as a group (STYLE.md §11)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> int:
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace_s`; returns the exit code.

    `proc` must have been started with `start_new_session=True`, so its pid is
    the group id and only processes we started are signalled.
    """
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return int(proc.returncode)


def raise_fd_limit(want: int = 65536) -> int:
    """Raise this process's open-file limit toward `want` (up to the hard limit); returns it.

    A gateway holds two sockets per request in flight (client and upstream);
    the common soft default of 1024 caps it near 500 concurrent streams.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft
