"""vLLM (Ray and multiprocessing) and SGLang replicas across two hosts, end to end: real etcd,
a router running the reconciler, two real agents (one in a network namespace joined by a
veth pair: another host), real Ray (`ray start`, from the test extras) and stub engine ranks
that really rendezvous (harness/rank_stubs), on recorded H100 inventories (a stand-in
nvidia-smi).

Rank 0 of each replica starts first; the stub ranks open their rendezvous point late (3 s),
so every other rank, started as soon as the reconciler relays that address, waits for it
and then joins; only rank 0 is routed to. Under Ray, the stub `vllm serve` serves once Ray's
own API lists both hosts' nodes with the GPUs they declared. A stub refuses to start unless
its devices and its NCCL/Gloo interface are the ones its host has. Killing one rank's raylet
rebuilds the replica whole and leaves no process of the old one, Ray's included; a rank
whose head never appears fails within its timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from cgn_core.etcd.local import LocalEtcd
from cgn_core.process import group_members
from harness import netns
from harness.poll import until
from harness.procs import Router, cgn_agent, cgn_router, etcd_put, etcd_run

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]
CTL = str(Path(sys.executable).parent / "cgn-ctl")
STUBS = Path(__file__).parent.parent / "harness" / "rank_stubs"
MODELS = {"big-ray": {"engine": "vllm"}, "big-mp": {"engine": "vllm", "launch_mode": "mp"},
          "big-sgl": {"engine": "sglang"}}  # fmt: skip


class Fleet:
    def __init__(self, etcd: str, router: Router, hosts: dict[str, str], state: Path):
        self.etcd, self.router, self.hosts, self.state = etcd, router, hosts, state


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if importlib.util.find_spec("ray") is None:
        assert not os.environ.get("CI"), "ray is not installed (the test extras pin it)"
        pytest.skip("real Ray is not installed: pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("multinode")
    with ExitStack() as stack:
        try:
            ns, there, here = stack.enter_context(netns.other_host())
        except netns.NetnsUnavailable as exc:
            pytest.skip(str(exc))
        etcd = LocalEtcd(tmp / "etcd", host=here)
        etcd.start()
        stack.callback(etcd.stop)
        # the venv's python3 runs the stubs: `vllm serve` on Ray asks Ray's API
        path = f"{STUBS / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"
        env = {**os.environ, "PATH": path, "PYTHONPATH": str(STUBS),
               "STUB_RENDEZVOUS_DELAY_S": "3"}  # fmt: skip
        hosts = {"n1": here, "n2": there}
        for node, addr in hosts.items():
            cfg = tmp / f"{node}.yaml"
            cfg.write_text(yaml.safe_dump({"labels": {"fabric": "lan"}}))
            prefix = ("ip", "netns", "exec", ns) if node == "n2" else ()
            stack.enter_context(cgn_agent(
                tmp / node, etcd.endpoint, "--config", str(cfg), "--set", "lease_ttl_s=2",
                "--set", f"engines.bind_host={addr}", "--set", f"engines.advertise_host={addr}",
                "--set", "engines.stop_on_exit=true", node=node, prefix=prefix, env=env,
            ))  # fmt: skip
        config = {"etcd": {"endpoints": [etcd.endpoint]},
                  "reconciler": {"interval_s": 0.3, "lease_ttl_s": 2, "rebuild_base_s": 0.5},
                  "scrape": {"interval_s": 0.5}}  # fmt: skip
        router = stack.enter_context(cgn_router(tmp, config))
        yield Fleet(etcd.endpoint, router, hosts, tmp)


def ctl(etcd: str, *args: str) -> str:
    res = subprocess.run([CTL, *args, "--etcd", etcd], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def ranks(etcd: str, model: str) -> dict[int, dict[str, Any]]:
    rows = json.loads(ctl(etcd, "replicas", "--json"))
    return {int(r["part"].split()[1].split("/")[0]): r for r in rows if r["model"] == model}


def ask(router: Router, model: str) -> str:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
        out = c.chat.completions.create(model=model, max_tokens=8,
                                        messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    return out.choices[0].message.content or ""


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def status_pid(etcd: str, node: str, replica: str) -> int:
    async def read(client: Any) -> int:
        return int((await client.get_json(f"/cognitora/replicas/{node}/{replica}"))["pid"])

    return etcd_run(etcd, read)


def test_each_engine_comes_up_across_two_hosts_in_order_and_is_served(fleet: Fleet) -> None:
    for name, profile in MODELS.items():
        spec = {"name": name, "source": "org/Big", "replicas": {"min": 1, "max": 1},
                "profiles": [{**profile, "accelerator": "h100-80g", "devices": 1, "nodes": 2,
                              "tensor_parallel": 2}]}  # fmt: skip
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-{os.getpid()}.yaml"
        path.write_text(yaml.safe_dump(spec))
        ctl(fleet.etcd, "models", "apply", "-f", str(path))
    started = []
    for name in MODELS:
        up = until(f"{name}'s two ranks are Ready",
                   lambda n=name: (r := ranks(fleet.etcd, n)) and len(r) == 2
                   and all(x["phase"] == "Ready" for x in r.values()) and r,
                   timeout_s=90)  # fmt: skip
        head, worker = up[0], up[1]
        started.append(worker)
        assert head["replica"] == worker["replica"] and head["node"] != worker["node"]
        # rank 0 reports its rendezvous point on its host's address; rank 1 serves nothing
        assert head["part"].startswith(f"rank 0/2 {fleet.hosts[head['node']]}:")
        assert worker["part"] == "rank 1/2"
        # one tensor-parallel group of 2 across the two hosts' one device each
        assert until(f"the router serves {name}", lambda n=name: ask(fleet.router, n),
                     timeout_s=30) == "served by 2 GPUs"  # fmt: skip
    # the ranks 1.. started before their heads listened, waited, and joined
    logs = [fleet.state / r["node"] / "logs" / f"{r['replica']}.log" for r in started]
    waited = [log for log in logs if "accepted a connection after" in log.read_text()]
    assert waited, [log.read_text() for log in logs]
    joined = ("rank-stub: joined", "Ray runtime started")  # the stub's words, Ray's
    assert all(any(w in log.read_text() for w in joined) for log in logs)
    # real Ray: rank 1's node joined rank 0's head, each with the GPU it declared
    head = ranks(fleet.etcd, "big-ray")[0]
    log = (fleet.state / head["node"] / "logs" / f"{head['replica']}.log").read_text()
    two = f"ray cluster: 2 node(s): {fleet.hosts['n1']} with 1 GPU(s), {fleet.hosts['n2']} with 1 GPU(s)"
    assert two in log, log[-3000:]
    status = json.loads(ctl(fleet.etcd, "status", "--json"))
    assert {m["model"]: m["ready"] for m in status["models"] if m["model"] in MODELS} == {
        name: 1 for name in MODELS
    }  # one endpoint each: the ranks behind rank 0 are never routed to
    explained = json.loads(ctl(fleet.etcd, "explain-placement", "big-ray", "--json"))
    envs = {r["node"]: r["env"] for r in explained["ranks"]}
    assert set(envs) == set(fleet.hosts), explained["candidates"]
    for node, addr in fleet.hosts.items():  # each host's own veth: the management interface
        iface = socket.if_nameindex() if node == "n1" else None
        assert envs[node]["NCCL_IB_DISABLE"] == "1"  # no RDMA port here
        assert envs[node]["VLLM_HOST_IP"] == addr
        gloo = envs[node]["GLOO_SOCKET_IFNAME"]
        assert envs[node]["NCCL_SOCKET_IFNAME"] == "=" + gloo
        if iface is not None:
            assert gloo in {name for _, name in iface} and gloo.startswith("cgnh")
        else:
            assert gloo.startswith("cgnp")


def test_killing_one_rank_rebuilds_the_replica_whole_and_leaves_no_sidecar(fleet: Fleet) -> None:
    before = until("big-ray is up", lambda: (r := ranks(fleet.etcd, "big-ray")) and len(r) == 2
                   and all(x["phase"] == "Ready" for x in r.values()) and r,
                   timeout_s=60)  # fmt: skip
    shards = [status_pid(fleet.etcd, r["node"], r["replica"]) for r in before.values()]
    head_group = group_members([shards[0]])
    assert len(head_group) >= 4  # the shard, `ray start`, Ray's daemons and vllm serve
    raylet = [p for p in group_members([shards[1]]) if command(p) == "raylet"]
    assert len(raylet) == 1, [command(p) for p in group_members([shards[1]])]
    os.kill(raylet[0], signal.SIGKILL)  # rank 1's node dies
    after = until("a new big-ray replica is Ready",
                  lambda: (r := ranks(fleet.etcd, "big-ray")) and len(r) == 2
                  and r[0]["replica"] != before[0]["replica"]
                  and all(x["phase"] == "Ready" for x in r.values()) and r,
                  timeout_s=90)  # fmt: skip
    assert after[0]["replica"] == after[1]["replica"]
    until("no process of the old replica is left", lambda: not group_members(shards),
          timeout_s=30)  # fmt: skip
    assert until("the router serves it again", lambda: ask(fleet.router, "big-ray"),
                 timeout_s=30) == "served by 2 GPUs"  # fmt: skip


def test_a_rank_whose_head_never_appears_fails_within_its_timeout(fleet: Fleet) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind((fleet.hosts["n1"], 0))
        nowhere = f"{fleet.hosts['n1']}:{s.getsockname()[1]}"
    placement = {"model": "lonely", "engine": "vllm", "source": "org/Big", "devices": [6, 7],
                 "profile": {"tensor_parallel": 2, "rendezvous_timeout_s": 2},
                 "pipeline": {"part": 1, "parts": 2, "head": "n1", "rendezvous": nowhere}}  # fmt: skip
    etcd_put(fleet.etcd, "/cognitora/placements/n2/lonely", placement)

    async def status(client: Any) -> Any:
        return await client.get_json("/cognitora/replicas/n2/lonely")

    failed = until("the rank fails", lambda: (s := etcd_run(fleet.etcd, status)) and
                   s["phase"] == "Failed" and s, timeout_s=30)  # fmt: skip
    assert failed["reason"] == (
        f"rank 0's rendezvous point {nowhere} did not accept a connection within 2 s"
    )
    assert failed["restarts"] == 0 and failed["pid"] is None  # not retried here
