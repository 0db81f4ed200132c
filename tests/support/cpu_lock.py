"""The suite runs on every core (pytest-xdist); a test marked `exclusive` runs alone.

A test whose assertion is a timing ratio (platinum TTFT under bronze load, a stream's longest
gap beside a 100k-token prompt) must not share the CPU with another test. Across xdist's
worker processes, one lock file per run is a readers-writer lock: every test holds it shared,
an `exclusive` test holds it exclusively, for its whole protocol (fixture setup included, so
the processes it measures start on a quiet machine). A second lock, the turnstile, gives the
writer priority: while an exclusive test waits, no new test starts, so it waits for the tests
in flight and no longer.

Without xdist (`-n 0`, or a single worker) nothing is locked.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

MARK = "exclusive"


def _lock_dir() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if run is None or workers < 2:
        return None
    return Path(tempfile.gettempdir()) / f"cgn-pytest-{run}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARK}: needs the machine to itself (a timing assertion); other workers pause",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    where = _lock_dir()
    if where is None:
        yield
        return
    where.mkdir(exist_ok=True)
    exclusive = item.get_closest_marker(MARK) is not None
    with (where / "turnstile").open("a") as turnstile, (where / "cpu").open("a") as cpu:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:  # keep the turnstile: no new test starts until this one is done
            fcntl.flock(cpu, fcntl.LOCK_EX)
        else:
            fcntl.flock(cpu, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cpu, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
