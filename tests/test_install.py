"""bin/install.sh against this checkout in an isolated HOME: every executable installed and answering."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parent.parent
EXES = [
    "cgn-router",
    "cgn-agent",
    "cgn-ctl",
    "cgn-kvcached",
    "cgn-metrics",
    "cgn-operator",
    "cgn-infer",
]


def test_installer_from_checkout_then_uninstall(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("VIRTUAL_ENV", None)
    res = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--from", str(REPO)], env=env,
                         capture_output=True, text=True, timeout=840)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    bin_dir = tmp_path / ".local/bin"
    assert f"into {bin_dir}" in res.stdout and "next: cgn-ctl up" in res.stdout
    for exe in EXES:
        help_ = subprocess.run([str(bin_dir / exe), "--help"], capture_output=True, text=True,
                               timeout=60, env=env)  # fmt: skip
        assert help_.returncode == 0 and exe in help_.stdout, (exe, help_.stderr)
    smollm2 = subprocess.run([str(bin_dir / "cgn-ctl"), "--version"], capture_output=True, text=True,
                             timeout=60, env=env)  # fmt: skip
    assert smollm2.returncode == 0
    bad = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--bogus"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 1 and "unknown option --bogus" in bad.stderr
    gone = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--uninstall"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert gone.returncode == 0 and "removed cognitora" in gone.stdout
    assert not any((bin_dir / exe).exists() for exe in EXES)
