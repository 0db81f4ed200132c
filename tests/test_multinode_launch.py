"""Multi-node vLLM and SGLang ranks, without agents: each engine's and rank's rendered argv and
environment against the engines' documented flags, the checks before launch, the
control plane's relay and whole-replica rebuild, and cgn_agent/shard.py with real processes
(a rank that waits for its head, a head that never appears, sidecars that never outlive it)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cgn_agent.drivers import DRIVERS, LaunchContext, PlacementRefused
from cgn_agent.inventory.types import Accelerator, Cpu, Inventory
from cgn_agent.node import rank_log
from cgn_agent.shard import EXIT_REASON, PLAN_ENV, Plan, Step
from cgn_agent.spec import EngineProfile, PipelinePart, ReplicaId, ReplicaSpec, parse_placement
from cgn_control.decide.catalog import CatalogError, parse_model
from cgn_control.decide.placement import Device, NodeView, place, rank_plan
from cgn_control.decide.reconciler import Delete, Memory, Put, Snapshot, reconcile
from cgn_core import multinode
from cgn_core.process import group_members
from cgn_core.records import node_inventory
from cgn_router.settings import ReconcilerSettings
from harness.poll import until

NCCL = multinode.nccl_env(("mlx5_0:1", "mlx5_1:1"), "eth0")


class Tools:
    def which(self, name: str) -> str | None:
        return {"vllm": "/v/bin/vllm", "ray": "/v/bin/ray"}.get(name)

    def has_module(self, name: str) -> bool:
        return True

    def is_file(self, path: str) -> bool:
        return True


def rank(engine: str, r: int, mode: str | None = None, **profile: Any) -> ReplicaSpec:
    return ReplicaSpec(
        ReplicaId("r1"), "big", engine, "org/Big", devices=(0, 1, 2, 3),
        profile=EngineProfile(**{"tensor_parallel": 4, "launch_mode": mode, "ctx": 8192, **profile}),
        pipeline=PipelinePart(r, 2, "n1", (), "10.0.0.1:29500" if r else ""),
    )  # fmt: skip


def ctx(r: int) -> LaunchContext:
    return LaunchContext(f"10.0.0.{r + 1}", 8100, python="/venv/bin/python",
                         token="t0k" if r == 0 else "", advertise_host=f"10.0.0.{r + 1}",
                         rendezvous_port=29500 if r == 0 else 0, nccl=NCCL)  # fmt: skip


MODEL = ["org/Big", "--tensor-parallel-size", "4", "--max-model-len", "8192",
         "--pipeline-parallel-size", "2"]  # fmt: skip
HTTP = ["--host", "10.0.0.1", "--port", "8100", "--served-model-name", "big"]
SGL = ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "org/Big"]
SGL_MODEL = ["--tp-size", "4", "--context-length", "8192", "--enable-metrics", "--pp-size", "2"]


def env(r: int, **extra: str) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": "0,1,2,3", **NCCL, **extra}


# real Ray drains a node for 30 s on SIGTERM, its daemons running meanwhile (#62)
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
# (engine, launch mode, rank) -> (commands: (argv, env, wait_for) in order, probe)
TABLE: dict[tuple[str, str | None, int], tuple[list[tuple[list[str], dict[str, str], str]], str]] = {
    ("vllm", "ray", 0): ([
        (["/v/bin/ray", "start", "--head", "--port", "29500", "--node-ip-address", "10.0.0.1",
          "--num-gpus", "4", "--disable-usage-stats", "--block"], env(0, VLLM_HOST_IP="10.0.0.1", **NO_DRAIN), ""),
        (["/v/bin/vllm", "serve", MODEL[0], *HTTP, *MODEL[1:], "--distributed-executor-backend",
          "ray"], env(0, VLLM_HOST_IP="10.0.0.1", VLLM_API_KEY="t0k",
                      RAY_ADDRESS="10.0.0.1:29500"), "10.0.0.1:29500"),
    ], "http"),
    ("vllm", "ray", 1): ([
        (["/v/bin/ray", "start", "--address", "10.0.0.1:29500", "--node-ip-address", "10.0.0.2",
          "--num-gpus", "4", "--disable-usage-stats", "--block"], env(1, VLLM_HOST_IP="10.0.0.2", **NO_DRAIN),
         "10.0.0.1:29500"),
    ], "alive"),
    ("vllm", "mp", 0): ([
        (["/v/bin/vllm", "serve", MODEL[0], *HTTP, *MODEL[1:], "--nnodes", "2", "--node-rank", "0",
          "--master-addr", "10.0.0.1", "--master-port", "29500"],
         env(0, VLLM_HOST_IP="10.0.0.1", VLLM_API_KEY="t0k"), ""),
    ], "http"),
    ("vllm", "mp", 1): ([
        (["/v/bin/vllm", "serve", *MODEL, "--nnodes", "2", "--node-rank", "1", "--master-addr",
          "10.0.0.1", "--master-port", "29500", "--headless"], env(1, VLLM_HOST_IP="10.0.0.2"),
         "10.0.0.1:29500"),
    ], "alive"),
    ("sglang", None, 0): ([
        ([*SGL, *HTTP, *SGL_MODEL, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
          "10.0.0.1:29500"], env(0), ""),
    ], "http"),
    ("sglang", None, 1): ([
        ([*SGL, *SGL_MODEL, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
          "10.0.0.1:29500"], env(1), "10.0.0.1:29500"),
    ], "alive"),
}  # fmt: skip
# Flags each engine documents for multi-node (vLLM's distributed serving guide: Ray and
# multiprocessing; SGLang's multi-node deployment; `ray start --help`)
DOCUMENTED = {
    "vllm": {"--host", "--port", "--served-model-name", "--tensor-parallel-size",
             "--max-model-len", "--pipeline-parallel-size", "--distributed-executor-backend",
             "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"},
    "ray": {"--head", "--port", "--address", "--node-ip-address", "--num-gpus", "--block",
            "--disable-usage-stats"},
    "sglang": {"--model-path", "--host", "--port", "--served-model-name", "--tp-size",
               "--context-length", "--enable-metrics", "--pp-size", "--nnodes", "--node-rank",
               "--dist-init-addr"},
}  # fmt: skip


@pytest.mark.parametrize("key", list(TABLE), ids=lambda k: f"{k[0]}-{k[1] or 'ranks'}-rank{k[2]}")
def test_each_engine_and_rank_renders_its_documented_commands_and_environment(
    key: tuple[str, str | None, int],
) -> None:
    engine, mode, r = key
    spec = rank(engine, r, mode)
    DRIVERS[engine].validate(spec, h100s(4), Tools())
    launch = DRIVERS[engine].launch(spec, ctx(r), Tools())
    commands, probe = TABLE[key]
    assert [(list(c.argv), dict(c.env), c.wait_for) for c in launch.commands] == commands
    assert (launch.probe, launch.endpoint, launch.restart) == (probe, probe == "http", False)
    assert launch.rendezvous == ("10.0.0.1:29500" if r == 0 else "")
    for c in launch.commands:
        program = "ray" if c.argv[0].endswith("ray") else engine
        assert {a for a in c.argv if a.startswith("--")} <= DOCUMENTED[program]
    # the agent's launch log shows every command with the environment that places it
    line = rank_log(spec, launch)
    assert f"rank {r}/2 of {engine}" in line and "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1" in line
    assert "t0k" not in line  # never a secret


def h100s(n: int, names: tuple[str, ...] = (), cap: str = "9.0") -> Inventory:
    gpu = tuple(
        Accelerator("nvidia", i, names[i] if names else "NVIDIA H100 80GB HBM3", "h100-80g",
                    81559, compute_capability=cap)
        for i in range(n)
    )  # fmt: skip
    return Inventory("g1", "g1", Cpu("x", 64, 1 << 20), gpu)


@pytest.mark.parametrize(
    ("spec", "node", "why"),
    [
        (rank("vllm", 0, tensor_parallel=3), h100s(4),
         "profile.tensor_parallel 3 does not divide 4 device(s) × 2 nodes = 8"),
        (rank("vllm", 1), h100s(4, ("NVIDIA H100 80GB HBM3",) * 3 + ("NVIDIA A100-SXM4-80GB",)),
         "devices mix GPU types in one tensor-parallel group (0: NVIDIA H100 80GB HBM3, "
         "1: NVIDIA H100 80GB HBM3, 2: NVIDIA H100 80GB HBM3, 3: NVIDIA A100-SXM4-80GB)"),
        (rank("vllm", 0, quantization="fp8"), h100s(4, cap="8.0"),
         "profile.quantization asks for FP8, which needs compute capability 8.9 or newer "
         "(0: 8.0, 1: 8.0, 2: 8.0, 3: 8.0)"),
        (rank("sglang", 0, mode="ray"), h100s(4), "profile.launch_mode is vLLM's (ray or mp)"),
    ],
)  # fmt: skip
def test_a_rank_the_node_cannot_run_is_refused_before_launch_naming_the_field(
    spec: ReplicaSpec, node: Inventory, why: str
) -> None:
    with pytest.raises(PlacementRefused, match=f"^{spec.engine}: " + re.escape(why)):
        DRIVERS[spec.engine].validate(spec, node, Tools())
    DRIVERS["vllm"].validate(rank("vllm", 0, quantization="fp8"), h100s(4, cap="8.9"), Tools())


def test_network_rules_and_the_records_that_carry_them() -> None:
    links = [multinode.Link("mlx5_3", 1, "ACTIVE", "Ethernet"),
             multinode.Link("mlx5_1", 1, "ACTIVE", "InfiniBand"),
             multinode.Link("mlx5_0", 1, "ACTIVE", "InfiniBand"),
             multinode.Link("mlx5_2", 1, "DOWN", "InfiniBand")]  # fmt: skip
    assert multinode.fabric_adapters(links) == ("mlx5_0:1", "mlx5_1:1")  # never RoCE beside IB
    assert multinode.fabric_adapters(links[:1]) == ("mlx5_3:1",)  # a RoCE-only fabric
    assert multinode.nccl_env((), "") == {"NCCL_IB_DISABLE": "1"}
    assert NCCL == {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_SOCKET_IFNAME": "=eth0",
                    "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip
    doc = {
        "address": "10.0.0.1",
        "iface": "eth0; rm -rf /",
        "network": [
            {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"},
            {"device": "../x", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"},
            "junk",
        ],
    }
    net = node_inventory(doc).network  # untrusted: a bad part reads as unknown
    assert (net.address, net.iface, net.fabric_adapters) == ("10.0.0.1", "", ("mlx5_0:1",))
    for bad, field in (({"launch_mode": "mp", "nodes": 1}, "launch_mode"),
                       ({"launch_mode": "slurm", "nodes": 2, "devices": 1}, "launch_mode"),
                       ({"rendezvous_timeout_s": 0}, "rendezvous_timeout_s")):  # fmt: skip
        profile = {"engine": "vllm", "accelerator": "h100-80g", **bad}
        with pytest.raises(CatalogError, match=rf"profiles\[0\]\.{field}"):
            parse_model({"name": "m", "source": "s", "profiles": [profile]})
    base = {"model": "m", "engine": "vllm", "pipeline": {"part": 0, "parts": 2, "head": "n1"}}
    with pytest.raises(ValueError, match=re.escape("'rendezvous' belongs to ranks 1..1")):
        parse_placement("r", {**base, "pipeline": {**base["pipeline"], "rendezvous": "a:1"}})


# ---- the control plane: placement, explain, relay, whole-replica rebuild --------------------

S = ReconcilerSettings(lost_after_s=30.0, max_local_failures=3, rebuild_base_s=2.0,
                       rebuild_cap_s=60.0, drain_grace_s=100.0)  # fmt: skip
BIG = {"name": "big", "source": "org/Big",
       "profiles": [{"engine": "vllm", "accelerator": "h100-80g", "devices": 4, "nodes": 2,
                     "tensor_parallel": 4}]}  # fmt: skip


def node_doc(address: str, devices: int = 4) -> dict[str, Any]:
    return {"accelerators": [{"index": i, "accel_class": "h100-80g"} for i in range(devices)],
            "engines": ["vllm"], "labels": {"fabric": "ib"}, "address": address,
            "iface": "eth0", "network": [{"device": "mlx5_0", "port": 1, "state": "ACTIVE",
                                          "link_layer": "InfiniBand"}]}  # fmt: skip


def cluster(placed: dict[tuple[str, str], dict[str, Any]], status: dict[Any, Any]) -> Snapshot:
    return Snapshot.of(models={"big": parse_model(BIG)},
                       nodes={"a": node_doc("10.0.0.1"), "b": node_doc("10.0.0.2")},
                       placements=placed, statuses=status, wall=1000.0)  # fmt: skip


def test_rank_0_starts_first_the_others_learn_its_rendezvous_and_any_failure_rebuilds_all() -> None:
    mem = Memory()
    first = reconcile(cluster({}, {}), mem, 0.0, S)
    assert [(type(a), a.node, a.doc["pipeline"]["part"]) for a in first] == [
        (Put, "a", 0), (Put, "b", 1)]  # fmt: skip
    placed = {(p.node, p.replica): p.doc for p in first}
    replica = first[0].replica
    assert reconcile(cluster(placed, {}), mem, 1.0, S) == []  # rank 0 has no address yet
    starting = {("a", replica): {"phase": "Loading", "pipeline": {
        "part": 0, "parts": 2, "head": "a", "address": "10.0.0.1:29500"}}}  # fmt: skip
    relay = reconcile(cluster(placed, starting), mem, 2.0, S)
    assert [(type(a), a.node) for a in relay] == [(Put, "b")]
    assert relay[0].doc["pipeline"]["rendezvous"] == "10.0.0.1:29500"
    placed[("b", replica)] = relay[0].doc
    assert reconcile(cluster(placed, starting), mem, 3.0, S) == []  # told once
    # one failure of one rank (not 3 in a row: its agent does not restart it) takes both
    lost = {**starting, ("b", replica): {"phase": "Failed", "reason": "engine exited with code 1",
                                         "failures": 1}}  # fmt: skip
    acts = reconcile(cluster(placed, lost), mem, 4.0, S)
    assert {(type(a), a.node) for a in acts} == {(Delete, "a"), (Delete, "b")}
    assert mem.rebuild_after["big"] > 4.0
    # explain shows each rank's command and environment from the nodes' records
    h100 = tuple(Device(i, "h100-80g") for i in range(4))
    d = place(parse_model(BIG), [NodeView(n, h100, frozenset({"vllm"}), "ib") for n in "ab"])
    plan = rank_plan(parse_model(BIG), d, cluster({}, {}).nodes)
    assert [(r["rank"], r["node"], r["runs"]) for r in plan] == [
        (0, "a", "ray head, then vllm serve (serves HTTP)"), (1, "b", "ray worker")]  # fmt: skip
    assert plan[1]["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "NCCL_IB_HCA": "=mlx5_0:1",
                              "NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0",
                              "VLLM_HOST_IP": "10.0.0.2"}  # fmt: skip
    assert plan[0]["rendezvous"].startswith("10.0.0.1:")


# ---- cgn_agent/shard.py: one rank's commands as one process group ---------------------------

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def shard(tmp_path: Path, steps: list[Step], timeout_s: float = 20.0) -> subprocess.Popen[bytes]:
    plan = Plan(tuple(steps), timeout_s, str(tmp_path / "reason"), grace_s=2.0)
    return subprocess.Popen(
        [sys.executable, "-m", "cgn_agent.shard", "r1"],
        env={**os.environ, PLAN_ENV: plan.to_json()},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_started_before_its_head_waits_then_joins(tmp_path: Path) -> None:
    """And a sidecar that exits while the rank waits fails it at once, with that reason."""
    port = free_port()
    proc = shard(tmp_path, [Step(("true",), {}, ""), Step(tuple(SLEEP), {}, f"127.0.0.1:{port}")])
    try:
        # the first command is a sidecar that exited: the shard fails before the wait ends
        assert proc.wait(timeout=30) == EXIT_REASON
        assert (tmp_path / "reason").read_text() == "sidecar true exited with code 0"
        (tmp_path / "reason").unlink()
        done = tmp_path / "joined"
        worker = [sys.executable, "-c", f"open({str(done)!r}, 'w').close()"]
        proc = shard(tmp_path, [Step(tuple(worker), {}, f"127.0.0.1:{port}")])
        time.sleep(1.0)
        assert proc.poll() is None and not done.exists()  # waiting, not started
        with socket.create_server(("127.0.0.1", port)):  # the head appears
            assert proc.wait(timeout=30) == 0 and done.exists()
    finally:
        proc.kill()


def test_a_head_that_never_appears_fails_the_rank_with_the_reason(tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    proc = shard(tmp_path, [Step(tuple(SLEEP), {}, f"127.0.0.1:{port}")], timeout_s=1.5)
    assert proc.wait(timeout=30) == EXIT_REASON
    assert 1.5 <= time.monotonic() - started < 15
    assert (tmp_path / "reason").read_text() == (
        f"rank 0's rendezvous point 127.0.0.1:{port} did not accept a connection within 1.5 s"
    )


def test_no_sidecar_outlives_its_rank_nor_a_stop(tmp_path: Path) -> None:
    """The sidecar (and a grandchild it started, which left for a process group of its own
    as Ray's workers do) goes when the rank exits, with the rank's exit code; a SIGTERM to
    the shard alone stops everything too."""
    nested = [sys.executable, "-c",
              "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              "'import os, time; os.setpgid(0, 0); time.sleep(600)']); time.sleep(600)"]  # fmt: skip
    rank_exits = [sys.executable, "-c", "import time, sys; time.sleep(1.5); sys.exit(3)"]
    proc = shard(tmp_path, [Step(tuple(nested), {}, ""), Step(tuple(rank_exits), {}, "")])
    until("the sidecar and its child run", lambda: len(group_members([proc.pid])) >= 4,
          timeout_s=20)  # fmt: skip
    assert proc.wait(timeout=30) == 3
    until("nothing of the group is left", lambda: not group_members([proc.pid]), timeout_s=10)
    proc = shard(tmp_path, [Step(tuple(nested), {}, ""), Step(tuple(SLEEP), {}, "")])
    until("all three run", lambda: len(group_members([proc.pid])) >= 4, timeout_s=20)
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    until("nothing of the group is left", lambda: not group_members([proc.pid]), timeout_s=10)


def test_a_drain_moves_a_multi_node_replica_whole_replacement_first() -> None:
    """Draining one rank's node places a whole new replica off it; the old one (every rank)
    goes only once the new rank 0 is Ready."""
    three = {n: node_doc(f"10.0.0.{i}", 8) for i, n in enumerate(("a", "b", "c"), 1)}
    base = {"model": "big", "engine": "vllm", "devices": [0, 1, 2, 3], "owner": "reconciler"}
    placed = {("a", "r1"): {**base, "pipeline": {"part": 0, "parts": 2, "head": "a"}},
              ("b", "r1"): {**base, "pipeline": {"part": 1, "parts": 2, "head": "a",
                                                   "rendezvous": "10.0.0.1:29500"}}}  # fmt: skip
    ready = {k: {"phase": "Ready"} for k in placed}

    def snap(placed: dict[Any, Any], status: dict[Any, Any]) -> Snapshot:
        return Snapshot.of(models={"big": parse_model(BIG)}, nodes=three, placements=placed,
                           statuses=status, cordons={"b": {"drain": True}}, wall=1000.0)  # fmt: skip

    mem = Memory()
    new = reconcile(snap(placed, ready), mem, 0.0, S)
    assert {(type(a), a.node) for a in new} == {(Put, "a"), (Put, "c")}  # off b, whole
    placed |= {(p.node, p.replica): p.doc for p in new}
    assert not any(isinstance(a, Delete) for a in reconcile(snap(placed, ready), mem, 1.0, S))
    head = next(p for p in new if p.doc["pipeline"]["part"] == 0)
    done = reconcile(snap(placed, {**ready, (head.node, head.replica): {"phase": "Ready"}}),
                     mem, 2.0, S)  # fmt: skip
    assert {(a.node, a.replica) for a in done if isinstance(a, Delete)} == {
        ("a", "r1"), ("b", "r1")}  # fmt: skip
