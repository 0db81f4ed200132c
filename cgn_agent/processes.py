"""Engine processes: spawn in their own group, recognise them again, stop them as a group.

A process is identified by a fingerprint: its pid, its command line
(/proc/<pid>/cmdline, read once the exec is done), its start time (clock
ticks since boot, /proc/<pid>/stat field 22) and the boot it started in
(/proc/sys/kernel/random/boot_id). A pid that the kernel gave to another
process since, or a process from an earlier boot, never matches, so a reused
pid is never adopted or signalled. Where /proc does not exist (macOS) the
start time and command come from `ps -o lstart=` and `ps -o command=`.

Every engine writes stdout and stderr to `<state_dir>/logs/<replica>.log`
(rotated once at 32 MiB on spawn); the tail of that file is what status
reports carry, before and after an agent restart alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from cgn_core.process import (
    Fingerprint,
    boot_id,
    cmdline,
    fingerprint,
    fingerprint_from_json,
    fingerprint_to_json,
    matches,
    start_time,
)

__all__ = [
    "EngineProcess",
    "Fingerprint",
    "boot_id",
    "cmdline",
    "fingerprint",
    "fingerprint_from_json",
    "fingerprint_to_json",
    "log_tail",
    "matches",
    "spawn",
    "start_time",
]
LOG_ROTATE_BYTES = 32 << 20
TAIL_BYTES = 4096


class EngineProcess:
    """A running engine: our child (with its Popen) or one adopted after an agent restart."""

    def __init__(self, fp: Fingerprint, popen: subprocess.Popen[bytes] | None = None):
        self.fp = fp
        self.popen = popen
        self._gone_code: int | None = None
        self._gone = False

    @property
    def pid(self) -> int:
        return self.fp.pid

    def poll(self) -> tuple[bool, int | None]:
        """(exited, exit code); an adopted process (not our child) exits with code None."""
        if self._gone:
            return True, self._gone_code
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return False, None
            self._gone, self._gone_code = True, code
            return True, code
        if matches(self.fp) and not _zombie(self.pid):
            return False, None
        self._gone = True
        return True, None

    def signal_group(self, sig: int) -> None:
        """Signal the engine's process group (its pid: it was started in a new session)."""
        if self.poll()[0]:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL it; returns the exit code."""
        self.signal_group(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while not self.poll()[0]:
            if loop.time() >= deadline:
                self.signal_group(signal.SIGKILL)
                deadline = loop.time() + 10.0
            await asyncio.sleep(0.05)
        return self.poll()[1]


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] == "Z"


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> EngineProcess:
    """Start `argv` in a new session with `env` added to ours, output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if log_path.stat().st_size > LOG_ROTATE_BYTES:
            os.replace(log_path, log_path.with_suffix(".log.1"))
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # NOTE: systemd's notification socket is the agent's own, not its engines'.
            env={**{k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}, **env},
            # NOTE: the replica's own directory, not the agent's: a relative path in a
            # placement (a hub id like `org/name` that an engine also tries as a local path)
            # can then only name something in there.
            cwd=log_path.parent,
            start_new_session=True,
        )
    fp = fingerprint(popen.pid) or Fingerprint(popen.pid, "", boot_id())
    return EngineProcess(fp, popen)


def log_tail(log_path: Path, lines: int = 20) -> list[str]:
    """The last `lines` lines of an engine's log (at most TAIL_BYTES read)."""
    try:
        with log_path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - TAIL_BYTES))
            data = fh.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    return [line[-300:] for line in text[-lines:]]
