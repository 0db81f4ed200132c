"""The control plane end to end: real etcd, a router running the reconciler, three agents with sim engines.

A model declared once with `cgn-ctl models apply` is placed and served; when
an agent and its engine are SIGKILLed, the node goes unreachable, then lost,
its replica is rebuilt on a survivor and the router stops routing there,
while four clients stream through the router; a drain under the same load
fails no request; a second router takes over reconciliation when the leader dies;
a disaggregated model keeps its prefill and decode pools when a node dies, and
long prompts keep being split between them with their KV moved; an elastic
model's replicas follow the load up and back down, and no stream is cut on
the replicas removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from cgn_agent.processes import EngineProcess
from cgn_agent.statefile import StateStore
from cgn_core.etcd.local import LocalEtcd
from harness.metrics import metric
from harness.poll import until as poll_until
from harness.procs import Agent, Router, cgn_agent, cgn_router, etcd_run

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(420)]
CTL = str(Path(sys.executable).parent / "cgn-ctl")
NODES = ("n1", "n2", "n3")
MODEL = "fleet"
RECONCILER = {"lost_after_s": 3.0, "interval_s": 0.3, "lease_ttl_s": 2, "rebuild_base_s": 0.5}
MODEL_YAML = f"""\
name: {MODEL}
source: smollm2
replicas: {{min: 2, max: 2}}
profiles:
  - engine: cgn_infer
    backend: sim
    threads: 1
    extra_args: [--speed, "10", --kv-pool-tokens, "16384", --max-batch, "8"]
"""
PD_YAML = MODEL_YAML.replace(f"name: {MODEL}", "name: pd").replace(
    "replicas: {min: 2, max: 2}", "pools: {prefill: 1, decode: 1}"
)


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.etcd = LocalEtcd(tmp / "etcd")
        self.stack = ExitStack()
        self.agents: dict[str, Agent] = {}
        self.routers: list[Router] = []

    def start(self) -> None:
        self.etcd.start()
        for node in NODES:
            self.agents[node] = self.stack.enter_context(cgn_agent(
                self.tmp / node, self.etcd.endpoint, "--set", "lease_ttl_s=2",
                "--set", "engines.stop_on_exit=true", "--set", "supervisor.drain_s=1.0",
                "--set", "supervisor.drain_timeout_s=3.0", node=node,
            ))  # fmt: skip
        config = {"etcd": {"endpoints": [self.etcd.endpoint]}, "reconciler": RECONCILER,
                  "scrape": {"interval_s": 0.5}, "breaker": {"failures": 1, "open_s": 30.0}}  # fmt: skip
        for i in range(2):
            (self.tmp / f"r{i}").mkdir()
            self.routers.append(self.stack.enter_context(cgn_router(self.tmp / f"r{i}", config)))

    def stop(self) -> None:
        self.stack.close()
        for node in NODES:  # engines of a killed agent, if a test failed before killing them
            for rec in StateStore(self.tmp / node).load_all():
                if rec.fingerprint is not None:
                    EngineProcess(rec.fingerprint).signal_group(signal.SIGKILL)
        self.etcd.stop()

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([CTL, *args, "--etcd", self.etcd.endpoint], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert res.returncode == 0, res.stderr
        return res

    def replicas(self) -> list[dict[str, Any]]:
        return list(json.loads(self.ctl("replicas", "--json").stdout))

    def ready(self) -> list[dict[str, Any]]:
        return [r for r in self.replicas() if r["phase"] == "Ready"]

    def leader(self) -> Router:
        live = [r for r in self.routers if r.proc.poll() is None]  # one may have been killed
        return next(r for r in live if admin(r, "/reconciler")["leading"])


def admin(router: Router, path: str) -> Any:
    with urllib.request.urlopen(router.admin + path, timeout=5) as resp:
        return json.load(resp)


def until(what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
    return poll_until(what, check, timeout_s, poll_s=0.2)


def routed_urls(router: Router) -> set[str]:
    return routed_urls_of(router, MODEL)


def routed_urls_of(router: Router, model: str) -> set[str]:
    return {e["url"] for e in admin(router, "/endpoints")["endpoints"] if e["model"] == model}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cp"))
    try:
        c.start()
        model = c.tmp / "fleet.yaml"
        model.write_text(MODEL_YAML)
        c.ctl("models", "apply", "-f", str(model))
        until("two Ready replicas", lambda: len(c.ready()) == 2, timeout_s=90)
        until("the router routing to both", lambda: len(routed_urls(c.routers[0])) == 2)
        yield c
    finally:
        c.stop()


class Load:
    """Clients streaming chat completions through the router until stopped."""

    def __init__(self, router: Router, clients: int = 4, model: str = MODEL, max_tokens: int = 12):
        self.model, self.max_tokens = model, max_tokens
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.serving: dict[int, tuple[str, float]] = {}  # client → its stream's endpoint, start
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(router.url, i), daemon=True)
                        for i in range(clients)]  # fmt: skip

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _client(self, url: str, i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        n = 0
        while not self.stop.is_set():
            n += 1
            got_first = False
            try:
                stream = client.chat.completions.create(
                    model=self.model, stream=True, max_tokens=self.max_tokens,
                    messages=[{"role": "user", "content": f"client {i} request {n}"}],
                )  # fmt: skip
                where = stream.response.headers.get("x-cognitora-endpoint", "")
                self.serving[i] = (where, time.monotonic())
                for chunk in stream:
                    got_first = got_first or bool(chunk.choices)
                outcome = "ok"
            except openai.OpenAIError as exc:
                outcome = "cut_mid_stream" if got_first else "failed"
                with self.lock:
                    self.errors.append(f"{outcome}: {type(exc).__name__}: {exc}")
            with self.lock:
                self.counts[outcome] += 1

    def wait_for(self, n: int) -> None:
        base = self.counts["ok"]
        until(f"{n} more completed requests", lambda: self.counts["ok"] >= base + n)


def test_killed_node_is_rebuilt_on_a_survivor_while_clients_stream(cluster: Cluster) -> None:
    before = {r["replica"]: r for r in cluster.ready()}
    victim = next(iter(before.values()))
    node = victim["node"]
    status = etcd_run(cluster.etcd.endpoint,
                      lambda c: c.get_json(f"/cognitora/replicas/{node}/{victim['replica']}"))  # fmt: skip
    router = cluster.leader()
    with Load(router) as load:
        load.wait_for(8)
        cluster.agents[node].proc.send_signal(signal.SIGKILL)
        os.killpg(status["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        until("the router to stop routing to the dead engine",
              lambda: victim["url"] not in routed_urls(router), timeout_s=15)  # fmt: skip
        states = [n["state"] for n in json.loads(cluster.ctl("nodes", "--json").stdout)
                  if n["node"] == node]  # fmt: skip
        assert states == ["unreachable"]  # first stage: its replica is kept
        rebuilt = until("a replacement Ready on a survivor", lambda: [
            r for r in cluster.ready() if r["replica"] not in before and r["node"] != node
        ], timeout_s=60)  # fmt: skip
        recovered_s = time.monotonic() - killed_at
        until("the router routing to two replicas", lambda: len(routed_urls(router)) == 2)
        assert node not in {r["node"] for r in cluster.replicas()}  # lost: its placement deleted
        load.wait_for(8)
    print(f"\nkill → replacement Ready in {recovered_s:.1f}s; requests: {dict(load.counts)}")
    for line in load.errors:
        print("  ", line)
    assert rebuilt[0]["node"] in NODES and load.counts["ok"] >= 16
    assert load.counts["failed"] == 0, load.errors  # nothing failed before its first byte
    # a stream the SIGKILL broke mid-way continued on the other replica (request migration)
    assert load.counts["cut_mid_stream"] == 0, load.errors


def test_drain_under_load_fails_no_request(cluster: Cluster) -> None:
    """Short streams and long ones (longer than the agents' 3 s drain_timeout_s): the drain
    ends in seconds, and what was still streaming continues on another replica."""
    until("two replicas Ready", lambda: len(cluster.ready()) == 2)  # a rebuild may be ending
    leader = cluster.leader()
    moved = metric(leader.admin, "cgn_router_migrations_total", result="continued")
    node = ""
    try:
        with Load(leader, 2, max_tokens=1500) as long, Load(leader) as load:
            load.wait_for(8)
            # the node of a long answer that has just begun is drained (<model>/<node>.<replica>):
            # it is stopped (drain_s + drain_timeout_s + 2 s) long before the answer would end

            def fresh() -> str:
                now = time.monotonic()
                return next((e for e, t in list(long.serving.values()) if e and now - t < 1.0), "")

            node = until("a long answer beginning", fresh).split("/")[1].split(".")[0]
            started = time.monotonic()
            res = cluster.ctl("drain", node, "--grace", "120")
            assert res.stdout.strip() == f"{node} drained"
            until("two Ready replicas off the drained node", lambda: len(
                [r for r in cluster.ready() if r["node"] != node]) == 2, timeout_s=60)  # fmt: skip
            until("the drained node's replica gone", lambda: node not in {
                r["node"] for r in cluster.replicas()}, timeout_s=60)  # fmt: skip
            drained_s = time.monotonic() - started
            load.wait_for(8)
    finally:
        if node:  # a failed drain must not leave a node cordoned for the tests after it
            cluster.ctl("uncordon", node)
    print(f"\ndrain of {node} in {drained_s:.1f} s: requests {dict(load.counts)}, "
          f"long {dict(long.counts)}")  # fmt: skip
    for each in (load, long):
        assert each.counts["failed"] == 0 and each.counts["cut_mid_stream"] == 0, each.errors
    assert drained_s < 30  # not the longest answer's time: its rest moved
    assert metric(leader.admin, "cgn_router_migrations_total", result="continued") > moved


def test_a_second_router_takes_over_reconciliation(cluster: Cluster, tmp_path: Path) -> None:
    leader = cluster.leader()
    other = next(r for r in cluster.routers if r is not leader)
    assert admin(other, "/reconciler")["leading"] is False
    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(10)
    until("the other router to lead", lambda: admin(other, "/reconciler")["leading"], timeout_s=20)
    model = tmp_path / "fleet3.yaml"
    model.write_text(MODEL_YAML.replace("{min: 2, max: 2}", "{min: 3, max: 3}"))
    cluster.ctl("models", "apply", "-f", str(model))
    until(
        "a third replica, placed by the new leader", lambda: len(cluster.ready()) == 3, timeout_s=60
    )
    recent = admin(other, "/reconciler")["recent_actions"]
    assert any(a["action"] == "place" for a in recent)


def pd_pools(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The Ready replicas of model pd by role."""
    return {r["role"]: r for r in cluster.ready() if r["model"] == "pd"}


def split_request(router: Router) -> tuple[str, str]:
    """A long new prompt through the router: its x-cognitora-pd and x-cgn-kv-transfer headers
    (new: a prompt the decode replica has cached is not worth splitting)."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)  # fmt: skip
    salt = time.monotonic_ns()
    words = " ".join(f"w{salt}.{i}" for i in range(200))  # over the 512-token threshold
    raw = client.chat.completions.with_raw_response.create(
        model="pd", max_tokens=8, messages=[{"role": "user", "content": words}]
    )
    assert raw.parse().choices[0].message.content
    return raw.headers.get("x-cognitora-pd", ""), raw.headers.get("x-cgn-kv-transfer", "")


def test_a_disaggregated_model_keeps_both_pools_when_a_node_dies(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = tmp_path / "pd.yaml"
    model.write_text(PD_YAML)
    cluster.ctl("models", "apply", "-f", str(model))
    pools = until("a Ready prefill and decode replica", lambda: (p := pd_pools(cluster)).keys()
                  == {"prefill", "decode"} and p, timeout_s=90)  # fmt: skip
    router = cluster.leader()
    until("the router routing to both pools", lambda: {r["url"] for r in pools.values()}
          <= routed_urls_of(router, "pd"))  # fmt: skip
    pd, moved = split_request(router)
    assert pd == f"disaggregated (prefill {endpoint_id(pools['prefill'])})"
    assert moved.startswith("fetched ")
    # the prefill replica's node dies: the pool is rebuilt on a survivor, and splits resume
    node = pools["prefill"]["node"]
    status = etcd_run(cluster.etcd.endpoint, lambda c: c.get_json(
        f"/cognitora/replicas/{node}/{pools['prefill']['replica']}"))  # fmt: skip
    cluster.agents[node].proc.send_signal(signal.SIGKILL)
    os.killpg(status["pid"], signal.SIGKILL)
    rebuilt = until("a new prefill replica Ready on a survivor", lambda: (
        p := pd_pools(cluster)).get("prefill", {}).get("node") not in (None, node) and p,
        timeout_s=90)  # fmt: skip
    assert rebuilt["decode"]["replica"] == pools["decode"]["replica"]  # spread: another node
    until("the router splitting onto the new prefill replica", lambda: split_request(router)[0]
          == f"disaggregated (prefill {endpoint_id(rebuilt['prefill'])})")  # fmt: skip


def endpoint_id(replica: dict[str, Any]) -> str:
    return f"pd/{replica['node']}.{replica['replica']}"


ELASTIC_YAML = """\
name: elastic
source: smollm2
replicas: {min: 1, max: 3}
scaling: {warmup_s: 1, up_cooldown_s: 2, down_cooldown_s: 4, stabilization_s: 8}
profiles:
  - engine: cgn_infer
    backend: sim
    threads: 1
    extra_args: [--speed, "2", --kv-pool-tokens, "4096", --max-batch, "2"]
"""


def elastic(cluster: Cluster) -> tuple[int, int]:
    """(placed, Ready) replicas of the elastic model."""
    mine = [r for r in cluster.replicas() if r["model"] == "elastic"]
    return len(mine), sum(r["phase"] == "Ready" for r in mine)


def test_replicas_follow_the_load_and_a_scale_down_cuts_no_stream(
    cluster: Cluster, tmp_path: Path
) -> None:
    """min 1, max 3, engines that run two requests at a time: eight streaming clients make
    requests wait, the leader learns a replica's batch (2) and speed, and scales to 3 in
    tokens per second; when the load falls to one client, it returns to 1 after its 8 s
    window, draining what it removes. With min 0 it then goes to zero, and a request holds
    until a replica serves it."""
    model = tmp_path / "elastic.yaml"
    model.write_text(ELASTIC_YAML)
    cluster.ctl("models", "apply", "-f", str(model))
    until("one elastic replica Ready", lambda: elastic(cluster) == (1, 1), timeout_s=90)
    router = cluster.leader()
    until("the router routing to it", lambda: routed_urls_of(router, "elastic"))
    with Load(router, clients=8, model="elastic", max_tokens=24) as rush:
        until("three Ready under the load", lambda: elastic(cluster) == (3, 3), timeout_s=120)
        rush.wait_for(8)
    with Load(router, clients=1, model="elastic", max_tokens=24) as trickle:
        until("back to one once the load fell", lambda: elastic(cluster) == (1, 1), timeout_s=120)
        trickle.wait_for(2)
    for load in (rush, trickle):
        assert load.counts["failed"] == 0 and load.counts["cut_mid_stream"] == 0, load.errors
    shown = json.loads(cluster.ctl("explain-scaling", "elastic", "--json").stdout)
    decision = shown["pools"][0]["decision"]
    steps = [(h["direction"], h["current"], h["desired"]) for h in decision["history"]]
    assert ("up", 1, 3) in steps or ("up", 2, 3) in steps, steps
    assert steps[-1][0] == "down" and steps[-1][2] == 1, steps
    # the router learned the replicas' speeds and the answers' shape: tokens per second,
    # each replica at its learned batch of 2
    assert decision["unit"] == "tokens/s" and decision["capacity"] > 0, decision
    reasons = [h["reason"] for h in decision["history"]]
    assert any("demand" in r and "tokens/s" in r for r in reasons), reasons
    # min 0: idle, it goes to zero; the next request is held at the router while the
    # autoscaler starts a replica for it, then served
    cluster.ctl("models", "scale", "elastic", "--min", "0")
    until("no replica while idle", lambda: elastic(cluster) == (0, 0), timeout_s=60)
    until("nothing routable", lambda: not routed_urls_of(router, "elastic"))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)  # fmt: skip
    started = time.monotonic()
    cold = client.chat.completions.create(
        model="elastic", max_tokens=4, messages=[{"role": "user", "content": "wake up"}]
    )
    print(f"\nfrom zero replicas to an answer in {time.monotonic() - started:.1f}s")
    assert cold.choices[0].message.content is not None
    cluster.ctl("models", "delete", "elastic")
    until("its replicas gone", lambda: elastic(cluster) == (0, 0), timeout_s=60)
