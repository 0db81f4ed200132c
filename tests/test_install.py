"""bin/install.sh against this checkout in an isolated HOME: two venvs (control plane without
torch, engine with it), every executable answering, and the README's first command serving a
chat completion from that layout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

from cgn_core.etcd.local import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(900)]
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
    venvs = tmp_path / ".local/share/cognitora/pipx/venvs"
    assert sorted(p.name for p in venvs.iterdir() if p.is_dir()) == [
        "cognitora-cluster",
        "cognitora-infer",
    ]
    has_torch = [subprocess.run([str(venvs / v / "bin/python"), "-c", "import torch"],
                                capture_output=True, timeout=120).returncode == 0
                 for v in ("cognitora-cluster", "cognitora-infer")]  # fmt: skip
    assert has_torch == [False, True]  # the control plane carries no torch
    assert (bin_dir / "cgn-infer").resolve().is_relative_to(venvs / "cognitora-infer")
    serve_from_install(bin_dir, tmp_path / "state", env)
    bad = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--bogus"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 1 and "unknown option --bogus" in bad.stderr
    index = tmp_path / "index"  # the wheels it built, standing in for PyPI below
    shutil.copytree(tmp_path / ".local/share/cognitora/wheels", index)
    uninstall(env, "removed cognitora-infer")
    assert not any((bin_dir / exe).exists() for exe in EXES)
    # The default source (`curl | sh`, no --from): the control plane by name from an index,
    # on a router-only node (--no-engine: the engine venv, torch and all, is what the first
    # install already covered, and takes most of its time).
    env["PIP_FIND_LINKS"] = f"{env.get('PIP_FIND_LINKS', '')} {index}".strip()
    res = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--no-model", "--no-engine"],
                         env=env, capture_output=True, text=True, timeout=840)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "installing the control plane" in res.stdout and "building" not in res.stdout
    assert "no cgn-infer on this node" in res.stdout and not (bin_dir / "cgn-infer").exists()
    assert subprocess.run([str(bin_dir / "cgn-ctl"), "--version"], env=env, capture_output=True,
                          timeout=60).returncode == 0  # fmt: skip
    uninstall(env, "cognitora-infer was not installed")
    assert not any((bin_dir / exe).exists() for exe in EXES)


def uninstall(env: dict[str, str], engine_line: str) -> None:
    gone = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--uninstall"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert gone.returncode == 0, gone.stderr
    assert engine_line in gone.stdout and "removed cognitora-cluster" in gone.stdout


def serve_from_install(bin_dir: Path, state: Path, env: dict[str, str]) -> None:
    """`cgn-ctl up` as the README runs it (the bin directory not on PATH): the agent in the
    control-plane venv must find cgn-infer in the engine venv; `down` stops everything."""
    env = {**env, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    ctl = str(bin_dir / "cgn-ctl")
    http, admin, agent, etcd = free_ports(4)
    up = subprocess.run([ctl, "up", "--state-dir", str(state), "--port", str(http),
                         "--admin-port", str(admin), "--agent-port", str(agent),
                         "--etcd-port", str(etcd), "--threads", "1"],
                        capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = json.loads((state / "up.json").read_text())
        client = openai.OpenAI(base_url=record["url"], api_key=record["key"], max_retries=0)
        out = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
        )
        assert out.choices[0].message.content
    finally:
        down = subprocess.run([ctl, "down", "--state-dir", str(state)], capture_output=True,
                              text=True, timeout=120, env=env)  # fmt: skip
    assert down.returncode == 0 and down.stdout.strip() == "stopped: agent, router, etcd", down
