"""Finding Cognitora's executables when they live in more than one venv.

bin/install.sh puts the control plane (cgn-router, cgn-agent, cgn-ctl, ...) and
the engine (cgn-infer, with torch) into separate pipx venvs and links every
executable into one bin directory. So an executable that needs a sibling looks,
in order, in the directory it was itself started from (that shared bin
directory, when started through it), in its own venv's bin, then on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys

from cgn_core.errors import ConfigError


def bin_dirs() -> tuple[str, ...]:
    """Directories searched before PATH, most specific first, without duplicates."""
    started = sys.argv[0] if sys.argv and sys.argv[0] else ""
    dirs = [
        os.path.dirname(os.path.abspath(started)) if started else "",
        os.path.dirname(sys.executable),
    ]
    return tuple(dict.fromkeys(d for d in dirs if d))


def find(name: str, dirs: tuple[str, ...] | None = None) -> str | None:
    """The path of executable `name`, or None where it is not installed."""
    for d in bin_dirs() if dirs is None else dirs:
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(name)


def require(name: str) -> str:
    """The path of executable `name`; ConfigError (with the way to install it) where missing."""
    found = find(name)
    if found is None:
        raise ConfigError(f"{name} is not installed (bin/install.sh installs every executable)")
    return found
