"""systemd units: what `cgn-ctl install-units` writes passes `systemd-analyze verify`; systemd/ is current."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from cgn_ctl import units

REPO = Path(__file__).resolve().parent.parent
CTL = str(Path(sys.executable).parent / "cgn-ctl")


def test_installed_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: .ci/run installs the systemd package"
    res = subprocess.run([CTL, "install-units", "--dir", str(tmp_path), "--with-etcd"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["cgn-agent.service", "cgn-infer@.service", "cgn-kvcached.service",
                     "cgn-metrics.service", "cgn-router.service", "cognitora-etcd.service",
                     "cognitora.target"]  # fmt: skip
    (tmp_path / "cgn-infer@demo.service").write_text((tmp_path / "cgn-infer@.service").read_text())
    files = [str(tmp_path / n) for n in ("cognitora.target", "cognitora-etcd.service",
             "cgn-router.service", "cgn-agent.service", "cgn-kvcached.service",
             "cgn-metrics.service", "cgn-infer@demo.service")]  # fmt: skip
    check = subprocess.run([analyze, "verify", "--man=no", *files], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert check.returncode == 0 and not check.stderr.strip(), check.stderr
    agent = (tmp_path / "cgn-agent.service").read_text()
    assert "KillMode=process" in agent and "NoNewPrivileges=yes" in agent and "Type=notify" in agent
    # and verify does catch a broken unit
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=/nonexistent/cgn-router\n")
    bad = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "broken.service")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0


def test_committed_units_match_the_generator() -> None:
    want = units.render(
        units.in_directory(Path("/opt/cognitora/bin")), Path("/opt/cognitora/bin/etcd")
    )
    have = {p.name: p.read_text() for p in (REPO / "systemd").iterdir()}
    assert have == want, "regenerate systemd/ with cgn_ctl.units.render (see its docstring)"
