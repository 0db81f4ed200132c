"""Two hosts in two commands, over mutual TLS (#65): `cgn-ctl up --listen` on host A (this
network namespace), the join command it prints on host B (another namespace, joined by a
veth pair), real processes end to end.

B gets its node certificate through the join service (its key made on B, the CA pinned by
hash) and its etcd user, starts its agent with mutual TLS and shows up Ready; A's replica,
drained, comes back on B and is served through A's router. No listener of the cluster
answers plaintext or a caller without a certificate; a spent token, another CA and an
unreachable service are one-line errors that write nothing; revoking B shuts it out.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness import netns
from harness.poll import until

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(400)]
CTL = str(Path(sys.executable).parent / "cgn-ctl")
B_NODE = "host-b"


@dataclass
class Hosts:
    ns: str
    here: str  # host A's address
    there: str  # host B's address
    a: Path  # A's state dir
    b: Path  # B's state dir
    record: dict[str, Any]  # A's up record
    join: list[str]  # the printed join command's arguments after `cgn-ctl`
    joined: subprocess.CompletedProcess[str]
    join_s: float  # B: from `up --join` to its node Ready


def ctl(
    state: Path, *args: str, ns: str = "", timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGN_CTL_")}
    return subprocess.run([*prefix, CTL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**env, "CGN_CTL_STATE_DIR": str(state)})  # fmt: skip


def nodes(h: Hosts) -> dict[str, str]:
    res = ctl(h.a, "nodes", "--json")
    assert res.returncode == 0, res.stderr
    return {n["node"]: n["state"] for n in json.loads(res.stdout)}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("twohosts")
    a, b = tmp / "a", tmp / "b"
    with ExitStack() as stack:
        try:
            ns, there, here = stack.enter_context(netns.other_host())
        except netns.NetnsUnavailable as exc:
            pytest.skip(str(exc))
        stack.callback(lambda: ctl(a, "down", timeout=120))
        up = ctl(a, "up", "--listen", here, "--threads", "1", "--port", "0", "--admin-port", "0",
                 "--agent-port", "0", "--etcd-port", "0", "--metrics-port", "0")  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        record = json.loads((a / "up.json").read_text())
        [line] = [x for x in up.stdout.splitlines() if x.startswith("cgn-ctl up --join ")]
        stack.callback(lambda: ctl(b, "down", ns=ns, timeout=120))
        started = time.monotonic()
        joined = ctl(b, *line.split()[1:], "--node-id", B_NODE, "--threads", "1", ns=ns)
        h = Hosts(ns, here, there, a, b, record, line.split()[1:], joined, 0.0)
        if joined.returncode == 0:
            until("B's node is Ready", lambda: nodes(h).get(B_NODE) == "ready", timeout_s=60)
        h.join_s = time.monotonic() - started
        yield h


def test_up_serves_https_and_prints_the_join_command(hosts: Hosts) -> None:
    r = hosts.record
    assert r["url"].startswith(f"https://{hosts.here}:") and r["ca_hash"].startswith("sha256:")
    assert hosts.join[:3] == ["up", "--join", r["join_url"].removeprefix("https://")]
    assert hosts.join[3] == "--token" and hosts.join[5:] == ["--ca-hash", r["ca_hash"]]
    with (
        openai.OpenAI(base_url=r["url"], api_key=r["key"], max_retries=0) as untrusting,
        pytest.raises(openai.APIConnectionError),  # the CA is not a public one
    ):
        untrusting.models.list()


def test_a_second_host_joins_and_serves_a_placed_replica_over_mutual_tls(hosts: Hosts) -> None:
    assert hosts.joined.returncode == 0, hosts.joined.stdout + hosts.joined.stderr
    assert hosts.joined.stdout.strip().startswith(f"node {B_NODE} joined the cluster at ")
    key = hosts.b / "pki" / f"{B_NODE}-agent.key"
    assert key.stat().st_mode & 0o777 == 0o600  # made on B, and only there
    print(f"\nup --join to a Ready node: {hosts.join_s:.1f}s")
    a_node = hosts.record["node"]
    drained = ctl(hosts.a, "drain", a_node, "--grace", "150", timeout=200)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    r = hosts.record
    with openai.OpenAI(base_url=r["url"], api_key=r["key"], max_retries=0, timeout=60,
                       http_client=httpx.Client(verify=ssl.create_default_context(
                           cafile=r["ca_file"]))) as client:  # fmt: skip
        raw = client.chat.completions.with_raw_response.create(
            model=r["model"], messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
        )
    assert raw.headers["x-cognitora-endpoint"].split("/", 1)[1].startswith(f"{B_NODE}.")
    assert raw.parse().choices[0].message.content is not None
    engine = until("B's engine endpoint", lambda: endpoint_url(hosts, B_NODE), timeout_s=10)
    assert engine.startswith(f"https://{hosts.there}:")  # the router reached it over HTTPS


def test_explain_route_asks_the_https_router_as_root(hosts: Hosts) -> None:
    """`cgn-ctl explain-route` reaches `up`'s admin listener (mutual TLS) with the root
    certificate `up` made; without a router, one line and exit 1."""
    r = hosts.record
    res = ctl(hosts.a, "explain-route", r["model"], "Say hi", "--chat", "--json", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    answer = json.loads(res.stdout)
    [chosen] = [c for c in answer["candidates"] if c["chosen"]]
    assert chosen["id"] == answer["chosen"] and chosen["predicted_ttft_ms"] > 0
    shown = ctl(hosts.a, "explain-route", r["model"], "Say hi", timeout=60)
    assert shown.returncode == 0 and answer["chosen"] in shown.stdout, shown.stderr
    gone = ctl(hosts.a, "explain-route", r["model"], "hi", "--router-admin",
               "http://127.0.0.1:9", timeout=60)  # fmt: skip
    assert gone.returncode == 1 and gone.stderr.startswith("error: cannot ask the router")
    assert len(gone.stderr.strip().splitlines()) == 1, gone.stderr


def endpoint_url(h: Hosts, node: str) -> str | None:
    res = ctl(h.a, "replicas", "--json")
    rows = [x for x in json.loads(res.stdout) if x["node"] == node and x["phase"] == "Ready"]
    return rows[0].get("url") if rows else None


def refuses_plaintext(host: str, port: int, path: str = "/replicas") -> bool:
    """Neither plaintext HTTP nor TLS without a client certificate gets an answer a caller
    could use: plaintext gets no HTTP response; TLS without a certificate, a failed handshake
    or a refusal (401/403) on a management path."""
    try:
        httpx.get(f"http://{host}:{port}{path}", timeout=5)
        return False
    except httpx.HTTPError:
        pass
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        got = httpx.get(f"https://{host}:{port}{path}", verify=ctx, timeout=5)
    except httpx.HTTPError:
        return True
    return got.status_code in (401, 403)


def test_no_listener_answers_plaintext_or_a_caller_without_a_certificate(hosts: Hosts) -> None:
    r = hosts.record
    etcd_host, etcd_port = r["etcd"].rsplit(":", 1)
    admin = [u.rsplit(":", 1) for u in (r["router_admin"], r["agent_admin"])]
    for host, port in [(etcd_host, etcd_port), *admin]:
        assert refuses_plaintext(host, int(port)), (host, port)
    b_admin = json.loads((hosts.b / "run" / "agent.ready").read_text())["ports"]["admin"]
    assert refuses_plaintext(hosts.there, int(b_admin))  # B's agent, across the veth pair
    engine = until("B's engine", lambda: endpoint_url(hosts, B_NODE), timeout_s=60)
    host, port = engine.removeprefix("https://").rsplit(":", 1)
    assert refuses_plaintext(host, int(port), "/v1/models")  # its engine, across the pair


def test_a_spent_token_another_ca_or_no_service_is_refused_and_writes_nothing(
    hosts: Hosts, tmp_path: Path
) -> None:
    args = hosts.join
    again = ctl(tmp_path / "c", *args, "--node-id", "host-c", ns=hosts.ns)
    assert again.returncode == 1 and "used up" in again.stderr, again.stderr
    other = [*args[:-1], "sha256:" + "0" * 64]
    pinned = ctl(tmp_path / "d", *other, "--node-id", "host-d", ns=hosts.ns)
    assert pinned.returncode == 1 and "not the one pinned" in pinned.stderr, pinned.stderr
    closed = [*args[:2], f"{hosts.here}:{free_closed_port(hosts.here)}", *args[3:]]
    gone = ctl(tmp_path / "e", *closed, "--node-id", "host-e", ns=hosts.ns)
    assert gone.returncode == 1 and "cannot reach the join service" in gone.stderr, gone.stderr
    for refused in (again, pinned, gone):
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not any((tmp_path / d / "pki").exists() for d in "cde")
    assert {"host-c", "host-d", "host-e"}.isdisjoint(nodes(hosts))
    bare = ctl(tmp_path / "f", "up", "--join", args[2])
    assert bare.returncode == 2 and "needs the --token and --ca-hash" in bare.stderr


def free_closed_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_revoking_the_joined_host_shuts_it_out(hosts: Hosts) -> None:
    """Last: B's etcd user goes, its certificate's serial is denied and its leases revoked."""
    pki = hosts.a / "pki"
    res = ctl(hosts.a, "pki", "revoke", B_NODE, "--dir", str(pki), "--reason", "test")
    assert res.returncode == 0, res.stderr
    assert (
        f"revoked {B_NODE} (joined)" in res.stdout and f"etcd user '{B_NODE}' deleted" in res.stdout
    )
    # its records went with its leases, and it cannot write them again (its etcd user is gone);
    # a node that still holds placements shows as unreachable until they move
    until("B's node is out", lambda: nodes(hosts).get(B_NODE) in (None, "unreachable"), 10)
    assert "permission denied" in until(
        "B's agent is refused by etcd",
        lambda: (t := (hosts.b / "logs" / "agent.log").read_text()).count("permission") and t,
        timeout_s=10,
    )
