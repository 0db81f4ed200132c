"""Child processes in their own process group, stopped as a group (STYLE.md §11), and
recognised again later by a fingerprint (pid, start time, boot id), so that a pid the
kernel reused is never taken for ours.

The command line is recorded for people to read but is not part of the identity: a
process may exec again and stay the same process (pip writes a `/bin/sh` trampoline
instead of a shebang when the interpreter's path is long, so a console script in a
deep pipx venv starts as `sh` and becomes `python`).

Where /proc does not exist (macOS) the start time and command come from `ps`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> int:
    """SIGTERM the process group `proc` leads, SIGKILL what is left of it once the leader has
    exited or after `grace_s`; returns the leader's exit code.

    `proc` must have been started with `start_new_session=True`, so its pid is
    the group id and only processes we started are signalled. Children that
    outlive their leader (a browser's renderers, still writing into its profile)
    are stopped with it.
    """
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):  # none left: the group is gone
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return int(proc.returncode)


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU
    quota (a container limited to 2 CPUs on a 64-core node gets 2, rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    try:
        quota, period = cgroup.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return cores


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


@dataclass(frozen=True, slots=True)
class Fingerprint:
    pid: int
    start: str  # start time as the OS reports it (ticks since boot, or ps's lstart)
    boot: str  # boot id ("" where the OS has none)
    cmdline: tuple[str, ...] = ()


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> str | None:
    """When `pid` started, or None if there is no such process or it has exited (a zombie:
    its parent, often init, has not reaped it yet; some inits reap only every few seconds)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _ps_start(pid)
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] == "Z" else fields[19]


def cmdline(pid: int) -> tuple[str, ...]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return ()
    except OSError:
        return (_ps(pid, "command") or "",)
    return tuple(raw.decode("utf-8", "surrogateescape").split("\0")[:-1])


def _ps_start(pid: int) -> str | None:
    return _ps(pid, "lstart")


def _ps(pid: int, field: str) -> str | None:
    try:
        out = subprocess.run(
            ["ps", "-o", f"{field}=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def fingerprint(pid: int, settle_s: float = 1.0) -> Fingerprint | None:
    """The fingerprint of a live process, or None if there is none with this pid.

    NOTE: right after subprocess.Popen (vfork + exec) returns, /proc/<pid>/cmdline can
    still read empty for a moment; a live process always has a command line, so an empty
    one is waited out (up to `settle_s`) to record something readable.
    """
    import time

    st = start_time(pid)
    if st is None:
        return None
    cmd = cmdline(pid)
    deadline = time.monotonic() + settle_s
    while not cmd and time.monotonic() < deadline and start_time(pid) == st:
        time.sleep(0.001)
        cmd = cmdline(pid)
    return Fingerprint(pid, st, boot_id(), cmd)


def fingerprint_to_json(fp: Fingerprint) -> dict[str, object]:
    return {"pid": fp.pid, "start": fp.start, "boot": fp.boot, "cmdline": list(fp.cmdline)}


def fingerprint_from_json(doc: Mapping[str, object]) -> Fingerprint:
    """The inverse of fingerprint_to_json; ValueError/TypeError on a damaged record."""
    pid, start, boot, cmd = doc["pid"], doc["start"], doc["boot"], doc["cmdline"]
    if not isinstance(pid, int) or not isinstance(start, str) or not isinstance(boot, str):
        raise ValueError("bad fingerprint")
    if not isinstance(cmd, list) or not all(isinstance(a, str) for a in cmd):
        raise ValueError("bad fingerprint command line")
    return Fingerprint(pid, start, boot, tuple(cmd))


def matches(fp: Fingerprint) -> bool:
    """True only if the process `fp` describes is still the one running under its pid:
    same start time and boot (whatever it has exec'd since)."""
    return start_time(fp.pid) == fp.start and boot_id() == fp.boot


def stop_pid_group(fp: Fingerprint, grace_s: float = 10.0) -> bool:
    """SIGTERM the group `fp` leads (only while `fp` still matches), SIGKILL after `grace_s`.

    Returns True if the process is gone afterwards. The process must have been
    started in its own session (its pid is its group id).
    """
    import time

    if not matches(fp):
        return True
    try:
        os.killpg(fp.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return not matches(fp)
    deadline = time.monotonic() + grace_s
    while matches(fp) and time.monotonic() < deadline:
        time.sleep(0.05)
    if matches(fp):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(fp.pid, signal.SIGKILL)
        time.sleep(0.2)
    return not matches(fp)


def group_members(groups: Iterable[int], proc: Path = Path("/proc")) -> list[int]:
    """Every live process whose process group or session is one of `groups` (Linux; []
    without /proc): the children an engine or a multi-node rank's sidecars started. An
    engine leads a session of its own, and a process that moved to a group of its own
    stays in that session (Ray puts each of its workers in a new group)."""
    want = set(groups)
    out: list[int] = []
    if not want or not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) in want or int(fields[3]) in want:  # state, ppid, pgrp, session
                out.append(int(entry.name))
    return sorted(out)
