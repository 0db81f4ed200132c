"""Where the suite's wall time goes across xdist workers: `CGN_TEST_TIMELINE=FILE` makes every
worker append one JSON line per test (worker, node id, start, end),
and `python -m tests.support.timeline FILE` prints each worker's busy and idle time and the
modules by wall time, the figures the suite's scheduling is tuned by (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "CGN_TEST_TIMELINE"


_started: dict[str, float] = {}
_controller = False  # xdist's controller is told of every worker's tests too: not recorded


def pytest_configure(config: pytest.Config) -> None:
    global _controller
    _controller = config.pluginmanager.hasplugin("dsession")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # NOTE: inside the CPU lock (tests/support/cpu_lock.py wraps the whole protocol), so a
    # test's time excludes its wait for the lock: that wait shows as the worker's idle time
    _started[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    path = os.environ.get(ENV)
    start = _started.pop(nodeid, None)
    if path and start is not None and not _controller:
        line = {
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "id": nodeid,
            "start": start,
            "end": time.time(),
        }
        with open(path, "a") as out:  # one short append per line: workers never interleave
            out.write(json.dumps(line) + "\n")


def report(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return f"{path}: no tests recorded"
    t0, t1 = min(r["start"] for r in rows), max(r["end"] for r in rows)
    out = [f"wall {t1 - t0:.0f} s over {len(rows)} tests"]
    busy: dict[str, float] = defaultdict(float)
    modules: dict[str, float] = defaultdict(float)
    for r in rows:
        busy[r["worker"]] += r["end"] - r["start"]
        modules[r["id"].split("::")[0]] += r["end"] - r["start"]
    for worker, seconds in sorted(busy.items()):
        out.append(f"{worker}: busy {seconds:.0f} s, idle {t1 - t0 - seconds:.0f} s")
    out.append("slowest modules (s):")
    for module, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[:25]:
        out.append(f"  {seconds:6.1f}  {module}")
    return "\n".join(out)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
