"""`cgn-ctl up` from nothing to a served SmolLM2 behind the router, then `cgn-ctl down` leaves nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from cgn_core.etcd.local import free_ports
from cgn_core.process import fingerprint_from_json, matches
from harness.procs import runs

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]
CTL = str(Path(sys.executable).parent / "cgn-ctl")


def ctl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CTL, *args], capture_output=True, text=True, timeout=timeout)


def test_up_serves_a_chat_completion_and_down_stops_everything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent, etcd = free_ports(2)
    started = time.monotonic()
    # --port 0 / --admin-port 0: any free port, and up must report the one the router took
    res = ctl("up", "--state-dir", str(state), "--port", "0", "--admin-port", "0",
              "--agent-port", str(agent), "--etcd-port", str(etcd), "--threads", "1")  # fmt: skip
    took = time.monotonic() - started
    record = json.loads((state / "up.json").read_text()) if (state / "up.json").exists() else {}
    try:
        assert res.returncode == 0, res.stderr
        url, key = record["url"], record["key"]
        assert f"OpenAI API: {url}" in res.stdout and key in res.stdout and "curl -s" in res.stdout
        assert re.search(r"replica smollm2-\w+: (Starting|Loading|Ready)", res.stderr)  # progress
        assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*/v1", url), url
        assert f"etcd:       {record['etcd']}" in res.stdout and "router admin: http" in res.stdout
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
        )
        assert out.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):  # auth is on
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        st = json.loads(ctl("status", "--state-dir", str(state), "--json").stdout)
        assert {p["name"] for p in st["local_processes"] if p["alive"]} == {
            "etcd",
            "router",
            "agent",
        }
        assert st["models"][0]["model"] == "smollm2" and st["models"][0]["ready"] == 1
        store = json.loads((state / "agent" / "kvcached.ready").read_text())  # the node's KV store
        assert runs(store["pid"], "cgn-kvcached")
        again = ctl("up", "--state-dir", str(state))
        assert again.returncode == 1 and "already up" in again.stderr
        # a second machine joining: here, a second agent with its own state and node id
        second = tmp_path / "second"
        joined = ctl("up", "--join", record["etcd"], "--state-dir", str(second),
                     "--node-id", "second-node", "--agent-port", str(free_ports(1)[0]))  # fmt: skip
        assert joined.returncode == 0, joined.stderr
        assert joined.stdout.strip() == f"node second-node joined the cluster at {record['etcd']}"
        nodes = json.loads(ctl("nodes", "--etcd", record["etcd"], "--json").stdout)
        assert {n["node"] for n in nodes} >= {"second-node", record["node"]}
        assert ctl("down", "--state-dir", str(second)).stdout.strip() == "stopped: agent"
        print(f"\ncgn-ctl up: {took:.1f}s to a served completion")
    finally:
        down = ctl("down", "--state-dir", str(state), timeout=120)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped: agent, router, etcd"
    for p in record.get("processes", []):
        assert not matches(fingerprint_from_json(p["fingerprint"])), p["name"]
    for rec in (state / "agent" / "replicas").glob("*.json"):  # the engine the agent ran
        assert not matches(fingerprint_from_json(json.loads(rec.read_text())["fingerprint"]))
    assert not runs(store["pid"], "cgn-kvcached")  # stopped with its agent
    assert ctl("down", "--state-dir", str(state)).stdout.strip() == "nothing was running"
