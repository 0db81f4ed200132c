"""A small real filesystem to fill up: a tmpfs mounted for one test (root only, else skipped)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(mnt: Path, size: str = "64k") -> Iterator[Path]:
    """Mount a `size` tmpfs at `mnt` for the block; skips the test where mounting is refused."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:  # fmt: skip
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
