"""Rewrite tests/durations.json (seconds per test module) from a run's JUnit XML.

    .venv/bin/pytest --junitxml=/tmp/run.xml
    .venv/bin/python scripts/test_durations.py /tmp/run.xml

The suite schedules the longest modules first (tests/conftest.py) so that its workers finish
together; a stale file only makes that order less good, never a test wrong.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[0] + "\nusage: test_durations.py RUN.xml")
    seconds: Counter[str] = Counter()
    for case in ET.parse(sys.argv[1]).iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/") + ".py"
        seconds[module] += float(case.get("time") or 0)
    ordered = {m: round(s, 1) for m, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    OUT.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{OUT}: {len(ordered)} modules, {sum(ordered.values()):.0f} s in all")


if __name__ == "__main__":
    main()
