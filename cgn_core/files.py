"""Files written so that a reader (or a crash) never sees half of one, and read only when they
are regular files of a bounded size."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` to a temp file beside `path`, fsync it, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write_json(path: Path, doc: Any, mode: int = 0o644) -> None:
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n", mode)


def open_regular(path: Path, *, follow_links: bool = True) -> tuple[int, os.stat_result]:
    """`path` opened read-only, and its stat: OSError unless it is a regular file.

    Opened non-blocking and checked before any read, so a FIFO, a device
    (`/dev/zero`) or a directory named where a file belongs is a one-line error,
    never a hang or an endless read. `follow_links=False` also refuses a symlink
    (for files in directories others may write to)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise OSError(errno.ELOOP, "a symlink, which is not followed here") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO, device or socket"
        raise OSError(errno.EINVAL, f"not a regular file ({kind})")
    os.set_blocking(fd, True)
    return fd, st


def read_regular(path: Path, max_bytes: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` (OSError beyond)."""
    fd, st = open_regular(path, follow_links=follow_links)
    try:
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes ({st.st_size})")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while read
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes")
    return data
