"""The private shared-memory directories of engines' KV transfer listeners, and reclaiming them.

A prefill engine moves blocks to same-host decode engines through files in a
directory of its own in /dev/shm (cgn_infer/transfer.py), named
`cgn-kv-transfer-<pid>-<random>` and removed when the engine stops. An engine
killed with SIGKILL cannot remove it, and tmpfs is memory: the agent reclaims
the directories of an engine it saw exit, and at start those of every engine
that is gone. Only directories of this user, never through a link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
SHM_ROOT = Path("/dev/shm")
PREFIX = "cgn-kv-transfer-"
_NAME = re.compile(rf"{PREFIX}(\d{{1,10}})-[A-Za-z0-9_]{{1,32}}")


def make_private(root: Path = SHM_ROOT) -> Path | None:
    """A fresh directory in `root` only this user can use (mkdtemp: 0700), named after this
    process; None when there is no tmpfs or it cannot be made."""
    if not root.is_dir():
        return None
    try:
        return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
    except OSError as exc:
        log.warning("KV transfer over shared memory off: %s", exc)
        return None


def reclaim(pid: int | None = None, root: Path = SHM_ROOT) -> list[Path]:
    """Remove the directories of process `pid` (one that exited), or with None of every
    process that is gone; what was removed."""
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            m = _NAME.fullmatch(entry.name)
            if m is None or (pid is not None and int(m[1]) != pid):
                continue
            if pid is None and _alive(int(m[1])):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    if removed:
        log.info("reclaimed %d KV transfer directories in %s", len(removed), root)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
