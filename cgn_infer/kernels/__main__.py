"""Prebuild cgn-infer's C kernels, so that no engine compiles them at its first start.

    python -m cgn_infer.kernels [--all] [--into DIR]

Builds this CPU's instruction-set path (`--all`: every path this machine's compiler can
target, for other CPUs too) into the package's `prebuilt/` folder (or DIR), where
`kernels.load()` finds it. scripts/setup-dev.sh and bin/install.sh run it where there is a
C compiler. Prints one line per path; exits 1 only if this CPU's path could not be built.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cgn_infer.kernels import prebuild
from cgn_infer.kernels.isa import ISAS, IsaError, current


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cgn_infer.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--all", action="store_true", help="every path the compiler can target")
    p.add_argument("--into", type=Path, help="the folder (default: the package's prebuilt/)")
    args = p.parse_args(argv)
    try:
        here = current().isa
    except IsaError as e:
        print(f"cgn-infer kernels: {e}", file=sys.stderr)
        return 1
    started = time.monotonic()
    built, skipped = prebuild(list(ISAS.values()) if args.all else [here], args.into)
    for path in built:
        print(f"cgn-infer kernels: ready {path}")
    for why in skipped:
        print(f"cgn-infer kernels: not built: {why}")
    print(f"cgn-infer kernels: {len(built)} path(s) in {time.monotonic() - started:.1f} s")
    return 0 if any(here.name in p.name for p in built) else 1


if __name__ == "__main__":
    sys.exit(main())
