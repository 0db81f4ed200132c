"""systemd units: what `cgn-ctl install-units` writes passes `systemd-analyze verify`; systemd/ is current."""

from __future__ import annotations

import json
import os
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


def test_units_with_a_pki_directory_carry_each_service_s_tls_and_verify(tmp_path: Path) -> None:
    """`install-units --pki DIR --node N` over the layout `cgn-ctl up` makes: each service its
    own leaf under the settings that take it (as environment, which its loader reads), etcd
    HTTPS with client certificates; a unit whose leaf is missing says so and gets none."""
    from cgn_ctl import uptls

    pki = tmp_path / "pki"
    uptls.prepare(pki, ["n1"])
    (pki / "n1-metrics.pem").unlink()  # as on a machine that runs no cgn-metrics
    out = tmp_path / "units"
    res = subprocess.run([CTL, "install-units", "--dir", str(out), "--with-etcd", "--pki",
                          str(pki), "--node", "n1"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (
        res.stderr.strip()
        == f"no TLS settings for cgn-metrics.service (n1-metrics.pem): not in {pki}"
    )
    router = (out / "cgn-router.service").read_text()
    assert f'Environment="CGN_ROUTER_ETCD__TLS__CERT_FILE={pki}/n1-router.pem"' in router
    assert f'Environment="CGN_ROUTER_ENGINE_TLS__CA_FILE={pki}/ca.pem"' in router
    assert f'Environment="CGN_ROUTER_TLS__KEY_FILE={pki}/n1-router.key"' in router
    assert "CGN_ROUTER_TLS__CA_FILE" not in router  # the OpenAI port asks clients for none
    agent = (out / "cgn-agent.service").read_text()
    assert f'Environment="CGN_AGENT_ENGINES__TLS__CERT_FILE={pki}/n1-agent.pem"' in agent
    assert f'"CGN_KVCACHED_TLS__CA_FILE={pki}/ca.pem"' in (out / "cgn-kvcached.service").read_text()
    assert 'Environment="CGN_METRICS' not in (out / "cgn-metrics.service").read_text()
    etcd = (out / "cognitora-etcd.service").read_text()
    assert "--listen-client-urls=https://127.0.0.1:2379" in etcd and "--client-cert-auth" in etcd
    check = subprocess.run([shutil.which("systemd-analyze") or "systemd-analyze", "verify",
                            "--man=no", *map(str, sorted(out.glob("*.service")))],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0 and not check.stderr.strip(), check.stderr
    # what the router's settings loader makes of that environment: its leaf, where it goes
    env = dict(line.removeprefix("Environment=").strip('"').split("=", 1)
               for line in router.splitlines() if line.startswith('Environment="CGN_'))  # fmt: skip
    shown = subprocess.run([str(Path(CTL).parent / "cgn-router"), "config", "--json"],
                           env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)
    assert settings["etcd"]["tls"]["cert_file"] == f"{pki}/n1-router.pem"
    assert settings["tls"] == {"ca_file": None, "cert_file": f"{pki}/n1-router.pem",
                               "key_file": f"{pki}/n1-router.key"}  # fmt: skip
    alone = subprocess.run([CTL, "install-units", "--dir", str(out), "--pki", str(pki)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert alone.returncode == 2 and "--pki and --node go together" in alone.stderr
