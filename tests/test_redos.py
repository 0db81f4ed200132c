"""No regular expression applied to untrusted input can be made to backtrack: each is run on
pumped hostile strings and must finish in time linear in them.

Every module-level compiled pattern of the packages (request fields, tool-call text from a
model, etcd records, catalog entries, API-key and shm names, the JSON depth pre-check) is
collected, so a new pattern is checked without being listed. The attack strings pump the
pattern's own characters and the usual backtracking triggers (quotes, escapes, spaces,
brackets) and end with a character that makes the match fail late; a pattern is refused when
16x the input costs more than 64x the time (quadratic is 256x) or one call takes a second.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import string
import time
from collections.abc import Iterator

import pytest

PACKAGES = ("cgn_core", "cgn_router", "cgn_infer", "cgn_agent", "cgn_control", "cgn_ctl",
            "cgn_metrics", "cgn_kvcached", "cgn_operator")  # fmt: skip
SKIP_MODULES = ("_pb2", "cgn_operator.run", "cgn_infer.kernels.build")  # generated or heavy
SMALL, BIG = 500, 8_000


def patterns() -> Iterator[tuple[str, re.Pattern[str] | re.Pattern[bytes]]]:
    for pkg in PACKAGES:
        root = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(root.__path__, pkg + "."):
            if any(s in info.name for s in SKIP_MODULES):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional dependency (mlx, kopf) this machine lacks
                continue
            for name, value in vars(module).items():
                if isinstance(value, re.Pattern) and getattr(module, "__name__", "") == info.name:
                    yield f"{info.name}.{name}", value


def attacks(pattern: str) -> list[str]:
    """Pumpable units: the pattern's own literal characters, pairs of them, and the classic
    backtracking triggers, each to be repeated and ended with a mismatch."""
    own = sorted({c for c in pattern if c in string.printable and c not in "\t\n\r\x0b\x0c"})
    units = [*own, *(a + b for a in own[:12] for b in own[:12])]
    units += ['\\"', '"', "\\", " ", "a", "0", "[", "{", "a ", "\\\\", "\\u", "aa\\", ". "]
    return units


def cost(p: re.Pattern[str] | re.Pattern[bytes], text: str) -> float:
    data: str | bytes = text.encode("latin-1", "replace") if isinstance(p.pattern, bytes) else text
    start = time.perf_counter()
    p.search(data)  # type: ignore[arg-type]
    p.sub("" if isinstance(data, str) else b"", data, count=0)  # type: ignore[arg-type]
    return time.perf_counter() - start


FOUND = sorted(patterns(), key=lambda x: x[0])


def test_the_packages_have_patterns_to_check() -> None:
    assert len(FOUND) >= 15  # the walk found them (a broken walk would check nothing)


@pytest.mark.parametrize(("name", "p"), FOUND, ids=[n for n, _ in FOUND])
def test_no_pattern_backtracks(name: str, p: re.Pattern[str] | re.Pattern[bytes]) -> None:
    source = p.pattern if isinstance(p.pattern, str) else p.pattern.decode("latin-1")
    for unit in attacks(source):
        for tail in ("\x00", "\n"):
            small = cost(p, unit * (SMALL // len(unit)) + tail)
            big = cost(p, unit * (BIG // len(unit)) + tail)
            assert big < 1.0, f"{name}: {big:.2f} s on {BIG} chars of {unit!r}"
            assert big < 64 * max(small, 2e-4), (
                f"{name}: {big / max(small, 1e-9):.0f}x the time for 16x {unit!r}: backtracks"
            )
