"""etcd RBAC against a real etcd with client-certificate auth: `cgn-ctl pki rbac` confines each
node's certificate to its own keys, a router's to reading and placing, and a real agent still
registers and serves its node under its role."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgn_core import pki, rbac
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.client import EtcdError
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings, TlsSettings
from harness.procs import cgn_agent, cgn_router

pytestmark = pytest.mark.etcd
CTL = str(Path(sys.executable).parent / "cgn-ctl")


@pytest.fixture(scope="module")
def pkidir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rbac-pki")
    ca = pki.create_ca()
    pki.write_pair(d, "ca", ca)
    pki.write_pair(d, "etcd", pki.issue(ca, "etcd", "etcd", ["127.0.0.1", "localhost"]))
    pki.write_pair(d, "root", pki.issue(ca, "root", "ctl", usage="client"))
    for node in ("n1", "n2", "r1"):
        pki.write_pair(d, node, pki.issue(ca, node, "agent", ["127.0.0.1"]))
    return d


def tls(d: Path, name: str) -> TlsSettings:
    return TlsSettings(
        ca_file=d / "ca.pem", cert_file=d / f"{name}.pem", key_file=d / f"{name}.key"
    )


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, pkidir: Path) -> Iterator[LocalEtcd]:
    """An etcd with client-cert auth, RBAC applied by `cgn-ctl pki rbac` as root."""
    server = LocalEtcd(tmp_path_factory.mktemp("rbac-etcd") / "data", tls=tls(pkidir, "etcd"))
    server.start()
    try:
        t = tls(pkidir, "root")
        env_sets = ["--etcd", server.endpoint]
        cfg = tmp_path_factory.mktemp("rbac-ctl") / "ctl.yaml"
        cfg.write_text(f"etcd: {{tls: {{ca_file: {t.ca_file}, cert_file: {t.cert_file}, "
                       f"key_file: {t.key_file}}}}}\n")  # fmt: skip
        res = subprocess.run([CTL, "pki", "rbac", "--node", "n1", "--node", "n2", "--router", "r1",
                              *env_sets, "--config", str(cfg)], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "n1: cgn-node-n1" in res.stdout and "r1: cgn-router" in res.stdout
        assert res.stdout.strip().endswith("etcd auth enabled")
        yield server
    finally:
        server.stop()


def client(server: LocalEtcd, pkidir: Path, who: str) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoints=(server.endpoint,), timeout_s=3.0,
                                   tls=tls(pkidir, who)))  # fmt: skip


async def refused(c: EtcdClient, key: str) -> bool:
    try:
        await c.put(key, "{}")
    except EtcdError as exc:
        assert "permission denied" in exc.message, exc.message
        return True
    return False


async def test_a_node_writes_only_its_own_keys(secured: LocalEtcd, pkidir: Path) -> None:
    async with client(secured, pkidir, "root") as root:
        await root.put_json("/cognitora/placements/n1/a", {"model": "m", "engine": "cgn_infer"})
        await root.put_json("/cognitora/placements/n2/b", {"model": "m", "engine": "cgn_infer"})
    async with client(secured, pkidir, "n1") as n1:
        for key in ("/cognitora/nodes/n1", "/cognitora/replicas/n1/a",
                    "/cognitora/endpoints/n1/m/a"):  # fmt: skip
            assert not await refused(n1, key), key
        assert [kv.key for kv in (await n1.get_prefix("/cognitora/placements/n1/"))[0]] == [
            "/cognitora/placements/n1/a"
        ]
        for key in (
            "/cognitora/placements/n2/evil",  # another node's work
            "/cognitora/placements/n1/evil",  # its own placements are read-only
            "/cognitora/replicas/n2/b",  # another node's status
            "/cognitora/endpoints/n2/m/b",  # another node's endpoints
            "/cognitora/nodes/n2",
            "/cognitora/endpoints/m/legacy",  # the hand-registered layout: admins only
            "/cognitora/catalog/models/m",
            "/cognitora/keys/00000000",
        ):
            assert await refused(n1, key), key
        with pytest.raises(EtcdError, match="permission denied"):
            await n1.get_prefix("/cognitora/keys/")  # API keys are routers' business


async def test_a_router_reads_everything_and_places(secured: LocalEtcd, pkidir: Path) -> None:
    async with client(secured, pkidir, "r1") as r1:
        await r1.get_prefix("/cognitora/")
        assert not await refused(r1, "/cognitora/placements/n2/c")
        assert not await refused(r1, "/cognitora/leader/reconciler")
        assert not await refused(r1, "/cognitora/usage/r1.w0")  # its count of tenants' usage
        assert await refused(r1, "/cognitora/keys/00000000")  # ctl's, not the router's
        assert await refused(r1, "/cognitora/tenants/acme")  # budgets are ctl's too
        assert await refused(r1, "/cognitora/nodes/n2")


async def test_a_real_agent_registers_under_its_role(
    secured: LocalEtcd, pkidir: Path, tmp_path: Path
) -> None:
    t = tls(pkidir, "n2")
    sets = ["--set", f"etcd.tls.ca_file={t.ca_file}", "--set", f"etcd.tls.cert_file={t.cert_file}",
            "--set", f"etcd.tls.key_file={t.key_file}"]  # fmt: skip
    with cgn_agent(tmp_path / "state", secured.endpoint, *sets, node="n2"):
        async with client(secured, pkidir, "root") as root:
            for _ in range(100):
                if await root.get("/cognitora/nodes/n2") is not None:
                    break
                await asyncio.sleep(0.1)
            assert (await root.get_json("/cognitora/nodes/n2"))["node"] == "n2"
            # its placement (the one root wrote for n2 above) was read, refused and reported
            for _ in range(100):
                status = await root.get_json("/cognitora/replicas/n2/b")
                if status is not None:
                    break
                await asyncio.sleep(0.1)
            assert status is not None and status["phase"] == "Failed"


def test_the_plan_is_what_the_docs_say() -> None:
    plan = rbac.plan(["n1"], ["n1"], ["ops"])
    assert plan.users == {"root": ("root",), "n1": ("cgn-node-n1", "cgn-router"), "ops": ("root",)}
    assert [(g.key, g.range_end, g.perm) for g in plan.roles["cgn-node-n1"]] == [
        ("/cognitora/nodes/n1", "", "readwrite"),
        ("/cognitora/replicas/n1/", "/cognitora/replicas/n10", "readwrite"),
        ("/cognitora/endpoints/n1/", "/cognitora/endpoints/n10", "readwrite"),
        ("/cognitora/kvcached/n1", "", "readwrite"),
        ("/cognitora/placements/n1/", "/cognitora/placements/n10", "read"),
        ("/cognitora/revoked/", "/cognitora/revoked0", "read"),
    ]
    assert rbac.prefix_end("ab") == "ac"


def test_a_revoked_node_is_refused_by_our_listeners_and_by_etcd(
    secured: LocalEtcd, pkidir: Path, tmp_path: Path
) -> None:
    """`cgn-ctl pki revoke n1`: n1's certificate stops opening the router's admin API (the
    deny-list the router follows) and etcd (its user is gone)."""
    r1 = tls(pkidir, "r1")
    config = {
        "etcd": {"endpoints": [secured.endpoint], "tls": {k: str(v) for k, v in (
            ("ca_file", r1.ca_file), ("cert_file", r1.cert_file), ("key_file", r1.key_file))}},
        "admin_tls": {"ca_file": str(r1.ca_file), "cert_file": str(r1.cert_file),
                      "key_file": str(r1.key_file)},
        "reconciler": {"enabled": False},
    }  # fmt: skip
    with cgn_router(tmp_path, config) as router:
        admin = router.admin.replace("http://", "https://")
        n1 = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        n1.load_cert_chain(pkidir / "n1.pem", pkidir / "n1.key")
        assert https_status(admin + "/endpoints", n1) == 200
        cfg = tmp_path / "ctl.yaml"
        root = tls(pkidir, "root")
        cfg.write_text(f"etcd: {{tls: {{ca_file: {root.ca_file}, cert_file: {root.cert_file}, "
                       f"key_file: {root.key_file}}}}}\n")  # fmt: skip
        res = subprocess.run([CTL, "pki", "revoke", "n1", "--dir", str(pkidir), "--etcd",
                              secured.endpoint, "--config", str(cfg), "--reason", "stolen"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "revoked n1.pem" in res.stdout and "etcd user 'n1' deleted" in res.stdout
        deadline = time.monotonic() + 15
        while https_status(admin + "/endpoints", n1) != 403:
            assert time.monotonic() < deadline, "the router never saw the revocation"
            time.sleep(0.1)
        assert https_status(admin + "/healthz", n1) == 200  # open paths stay open

    async def n1_put() -> None:
        async with client(secured, pkidir, "n1") as c:
            await c.put("/cognitora/nodes/n1", "{}")

    with pytest.raises(EtcdError):
        asyncio.run(n1_put())


def https_status(url: str, ctx: ssl.SSLContext) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code
