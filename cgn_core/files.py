"""Files written so that a reader (or a crash) never sees half of one, and read only when they
are regular files of a bounded size."""

from __future__ import annotations

import contextlib
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


MAX_LINK_HOPS = 40  # as the kernel's own limit on a path's symlinks


def open_dir_safely(path: Path, mode: int = 0o700) -> int:
    """A descriptor of the directory `path` (made, with `mode`, where it or a parent is
    missing), reached one component at a time from "/": a symlink on the way is followed
    only when root owns it (the system's own: /var/run -> /run), and the last component is
    never one. So a link planted by another user in a world-writable directory (/dev/shm)
    cannot move `path` elsewhere, at any depth. OSError(ELOOP) names such a link."""
    parts = list(Path(os.path.abspath(path)).parts[1:])
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    hops = 0
    try:
        while parts:
            name = parts.pop(0)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=fd)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if not parts or st.st_uid != 0 or hops > MAX_LINK_HOPS:
                    why = f"{name} is a symlink (owner uid {st.st_uid}), which is not followed"
                    raise OSError(errno.ELOOP, why)
                target = Path(os.readlink(name, dir_fd=fd))
                if target.is_absolute():
                    os.close(fd)
                    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    parts = [*target.parts[1:], *parts]
                else:
                    parts = [*target.parts, *parts]
                continue
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            inner = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd
