"""The private CA and mutual TLS: certificates, cgn-ctl pki, etcd with client-cert auth, gRPC, admin HTTPS."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from cgn_core import pki
from cgn_core.errors import EtcdUnavailable
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings, TlsSettings
from cgn_core.tls import NodeIdentityInterceptor, channel_credentials, server_credentials
from cgn_proto.cognitora.v1 import kv_events_pb2 as pb
from cgn_proto.cognitora.v1 import kv_events_pb2_grpc as pb_grpc
from harness.poll import until
from harness.procs import cgn_agent, cgn_router

CTL = str(Path(sys.executable).parent / "cgn-ctl")
AGENT = str(Path(sys.executable).parent / "cgn-agent")


# ---- certificates --------------------------------------------------------------------------


def test_ca_and_leaf_carry_what_peers_check() -> None:
    ca = pki.create_ca()
    leaf = pki.issue(ca, "gpu-07", "agent", ["10.0.0.7", "gpu-07.lan"])
    d = pki.describe(leaf.cert, ca.cert)
    assert d["common_name"] == "gpu-07" and d["sans"] == ["gpu-07", "10.0.0.7", "gpu-07.lan"]
    assert d["extended_key_usage"] == ["serverAuth", "clientAuth"] and not d["is_ca"]
    assert d["key"] == "ECDSA secp256r1" and d["chain"] == "ok" and 360 <= d["days_left"] <= 365
    c = pki.describe(ca.cert)
    assert c["is_ca"] and c["path_length"] == 0 and c["key_usage"] == ["key_cert_sign", "crl_sign"]
    pki.verify(leaf.cert, ca.cert, usage="client", node="gpu-07")


def test_verify_names_the_check_that_fails() -> None:
    ca, other = pki.create_ca(), pki.create_ca("Someone else's CA")
    old = pki.issue(ca, "n1", "agent", days=1,
                    not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))  # fmt: skip
    cases = [
        (pki.issue(other, "n1", "agent").cert, {}, "was not issued by this cluster's CA"),
        (old.cert, {}, "certificate 'n1' expired on"),
        (pki.issue(ca, "n2", "agent").cert, {"node": "n1"},
         "certificate CN 'n2' does not match the claimed node id 'n1'"),
        (pki.issue(ca, "n1", "agent", usage="server").cert, {"usage": "client"},
         "certificate 'n1' is not valid for client authentication"),
    ]  # fmt: skip
    for cert, kw, message in cases:
        with pytest.raises(pki.PkiError, match=message):
            pki.verify(cert, ca.cert, **kw)  # type: ignore[arg-type]
    with pytest.raises(pki.PkiError, match="role must be one of"):
        pki.issue(ca, "n1", "king")


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CTL, "pki", *args], capture_output=True, text=True, timeout=60)


def test_ctl_pki_bootstrap_issue_inspect_rotate(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    res = ctl("bootstrap", "--dir", str(d), "--node", "n1", "--role", "agent")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"CA created: {d}/ca.pem", f"issued {d}/n1-agent.pem"]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "n1-agent.key").stat().st_mode) == 0o600
    serial = pki.load_cert(d / "ca.pem").serial_number
    again = ctl("bootstrap", "--dir", str(d), "--node", "n1", "--role", "agent")
    assert again.stdout.splitlines() == [f"CA {d}/ca.pem exists: kept (--force replaces it)",
                                         f"kept {d}/n1-agent.pem"]  # fmt: skip
    assert pki.load_cert(d / "ca.pem").serial_number == serial  # never silently replaced
    forced = ctl("bootstrap", "--dir", str(d), "--force")
    assert "old CA kept as ca.pem." in forced.stdout and list(d.glob("ca.key.*.bak"))
    assert pki.load_cert(d / "ca.pem").serial_number != serial
    # the leaf from the old CA no longer checks out against the new one
    doc = json.loads(ctl("inspect", str(d / "n1-agent.pem"), "--json").stdout)
    assert doc["chain"] == "FAILED: certificate 'n1': signature does not verify against the CA"
    assert ctl("issue", "--dir", str(d), "--node", "n1", "--role", "agent").stderr.strip() == (
        f"error: {d}/n1-agent.pem exists (--force replaces it)"
    )
    res = ctl(
        "issue", "--dir", str(d), "--node", "n1", "--role", "agent", "--san", "10.1.2.3", "--force"
    )
    assert res.returncode == 0
    text = ctl("inspect", str(d / "n1-agent.pem")).stdout
    assert "common_name          n1" in text and "sans                 n1, 10.1.2.3" in text
    assert "chain                ok" in text
    before = pki.load_cert(d / "n1-agent.pem")
    rot = ctl("rotate", "--dir", str(d), "--all")
    assert rot.returncode == 0 and "re-issued" in rot.stdout
    after = pki.load_cert(d / "n1-agent.pem")
    assert after.serial_number != before.serial_number
    assert pki.describe(after)["sans"] == ["n1", "10.1.2.3"]
    assert "nothing expires within 30 days" in ctl("rotate", "--dir", str(d)).stdout
    assert (
        ctl("issue", "--dir", str(tmp_path / "none"), "--node", "x", "--role", "agent").returncode
        == 1
    )


# ---- etcd with client-certificate auth --------------------------------------------------------


@pytest.fixture(scope="module")
def pkidir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = pki.create_ca()
    pki.write_pair(d, "ca", ca)
    pki.write_pair(d, "etcd", pki.issue(ca, "etcd", "etcd", ["127.0.0.1", "localhost"]))
    for node in ("n1", "n2"):
        pki.write_pair(d, f"{node}-agent", pki.issue(ca, node, "agent", ["127.0.0.1"]))
    pki.write_pair(d, "n1-expired", pki.issue(ca, "n1", "agent", days=1,
                   not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3)))  # fmt: skip
    pki.write_pair(d, "n1-serveronly", pki.issue(ca, "n1", "agent", usage="server"))
    other = pki.create_ca("Another CA")
    pki.write_pair(d, "other-ca", other)
    pki.write_pair(d, "n1-foreign", pki.issue(other, "n1", "agent"))
    return d


def tls(d: Path, name: str) -> TlsSettings:
    return TlsSettings(
        ca_file=d / "ca.pem", cert_file=d / f"{name}.pem", key_file=d / f"{name}.key"
    )


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory, pkidir: Path) -> Iterator[LocalEtcd]:
    server = LocalEtcd(tmp_path_factory.mktemp("etcd-tls") / "data", tls=tls(pkidir, "etcd"))
    server.start()
    yield server
    server.stop()


def etcd_settings(server: LocalEtcd, t: TlsSettings) -> EtcdSettings:
    # NOTE: a refused certificate fails at once whatever the timeout; a good one on a machine
    # busy with other tests (a TLS handshake, an fsync) may need more than etcd's usual second
    return EtcdSettings(endpoints=(server.endpoint,), timeout_s=10.0, tls=t)


@pytest.mark.etcd
@pytest.mark.parametrize(
    ("cert", "reason"),
    [
        ("n1-foreign", "unknown authority"),
        ("n1-expired", "expired"),
        ("n1-serveronly", "incompatible key usage"),
        (None, "didn't provide a certificate"),
    ],
)
async def test_etcd_refuses_bad_client_certificates_and_says_why(
    secure_etcd: LocalEtcd, pkidir: Path, cert: str | None, reason: str
) -> None:
    t = tls(pkidir, cert) if cert else TlsSettings(ca_file=pkidir / "ca.pem")
    async with EtcdClient(etcd_settings(secure_etcd, t)) as c:
        with pytest.raises(EtcdUnavailable):
            await c.get("/cognitora/nodes/n1")
    # etcd logs the refusal as it handles it, which on a busy machine can trail our failure
    until(f"etcd logs {reason!r}", lambda: reason in secure_etcd.log_path.read_text(
        errors="replace"), timeout_s=15)  # fmt: skip


@pytest.mark.etcd
async def test_agent_with_valid_certificates_registers_and_guards_its_admin_api(
    secure_etcd: LocalEtcd, pkidir: Path, tmp_path: Path
) -> None:
    t = tls(pkidir, "n1-agent")
    sets = ["--set", f"etcd.tls.ca_file={t.ca_file}", "--set", f"etcd.tls.cert_file={t.cert_file}",
            "--set", f"etcd.tls.key_file={t.key_file}", "--set", f"admin_tls.ca_file={t.ca_file}",
            "--set", f"admin_tls.cert_file={t.cert_file}", "--set", f"admin_tls.key_file={t.key_file}"]  # fmt: skip
    with cgn_agent(tmp_path / "state", secure_etcd.endpoint, *sets, node="n1") as agent:
        async with EtcdClient(etcd_settings(secure_etcd, tls(pkidir, "n2-agent"))) as c:
            for _ in range(100):
                if await c.get("/cognitora/nodes/n1") is not None:
                    break
                await asyncio.sleep(0.1)
            assert (await c.get_json("/cognitora/nodes/n1"))["node"] == "n1"
        base = agent.admin.replace("http://", "https://")
        anonymous = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        assert get(base + "/healthz", anonymous)[0] == 200  # probes need no certificate
        status, body = get(base + "/replicas", anonymous)
        assert status == 403 and "client certificate" in body["error"]["message"]
        n2 = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        n2.load_cert_chain(pkidir / "n2-agent.pem", pkidir / "n2-agent.key")
        assert get(base + "/replicas", n2)[0] == 200
        status, body = get(base + "/replicas", n2, {"x-cgn-node": "n1"})
        assert status == 403
        assert (
            body["error"]["message"]
            == "certificate CN 'n2' does not match the claimed node id 'n1'"
        )


def get(url: str, ctx: ssl.SSLContext, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.load(exc)


def test_agent_refuses_to_start_with_a_certificate_for_another_node(
    pkidir: Path, tmp_path: Path
) -> None:
    t = tls(pkidir, "n2-agent")
    res = subprocess.run(
        [AGENT, "run", "--node-id", "n1", "--state-dir", str(tmp_path), "--etcd", "127.0.0.1:1",
         "--set", f"etcd.tls.ca_file={t.ca_file}", "--set", f"etcd.tls.cert_file={t.cert_file}",
         "--set", f"etcd.tls.key_file={t.key_file}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().endswith(
        f"etcd.tls.cert_file {t.cert_file}: certificate CN 'n2' does not match the claimed node id 'n1'"
    )


# ---- gRPC: the shared credentials helper and the node-identity check ----------------------------


class Events(pb_grpc.KvEventsServicer):  # type: ignore[misc]
    async def Subscribe(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield pb.KvEventEnvelope(snapshot=pb.KvSnapshot(seq=7))


@pytest.fixture
async def grpc_server(pkidir: Path) -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[NodeIdentityInterceptor()])
    pb_grpc.add_KvEventsServicer_to_server(Events(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls(pkidir, "etcd")))
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def subscribe(target: str, t: TlsSettings, node: str | None) -> int:
    opts = [("grpc.ssl_target_name_override", "localhost")]
    async with grpc.aio.secure_channel(target, channel_credentials(t), options=opts) as ch:
        metadata = (("x-cgn-node", node),) if node else ()
        call = pb_grpc.KvEventsStub(ch).Subscribe(pb.SubscribeKvEventsRequest(), metadata=metadata,
                                                  timeout=5)  # fmt: skip
        async for msg in call:
            return int(msg.snapshot.seq)
    return -1


async def test_grpc_mtls_checks_the_certificate_against_the_claimed_node(
    grpc_server: str, pkidir: Path
) -> None:
    assert await subscribe(grpc_server, tls(pkidir, "n1-agent"), "n1") == 7
    with pytest.raises(grpc.aio.AioRpcError) as wrong:
        await subscribe(grpc_server, tls(pkidir, "n2-agent"), "n1")
    assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert wrong.value.details() == "certificate CN 'n2' does not match the claimed node id 'n1'"
    with pytest.raises(grpc.aio.AioRpcError) as anonymous:
        await subscribe(grpc_server, TlsSettings(ca_file=pkidir / "ca.pem"), "n1")
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        await subscribe(grpc_server, tls(pkidir, "n1-foreign"), "n1")
    assert foreign.value.code() == grpc.StatusCode.UNAVAILABLE


def test_router_serves_https_and_guards_its_admin_api(pkidir: Path, tmp_path: Path) -> None:
    t = tls(pkidir, "n1-agent")  # any leaf with serverAuth and the 127.0.0.1 SAN
    config = {
        "discovery": "static",
        "endpoints": {"e1": {"url": "http://127.0.0.1:9", "model": "m"}},
        "tls": {"cert_file": str(t.cert_file), "key_file": str(t.key_file)},
        "admin_tls": {
            "ca_file": str(t.ca_file),
            "cert_file": str(t.cert_file),
            "key_file": str(t.key_file),
        },
    }
    with cgn_router(tmp_path, config) as router:
        trust = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        status, body = get(router.url.replace("http://", "https://") + "/v1/models", trust)
        assert status == 200 and [m["id"] for m in body["data"]] == ["m"]
        admin = router.admin.replace("http://", "https://")
        assert get(admin + "/healthz", trust)[0] == 200
        assert get(admin + "/endpoints", trust)[0] == 403
        mine = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        mine.load_cert_chain(pkidir / "n2-agent.pem", pkidir / "n2-agent.key")
        assert get(admin + "/endpoints", mine)[0] == 200


def test_engines_over_mutual_tls(pkidir: Path, tmp_path: Path) -> None:
    """An engine serving HTTPS with its node's certificate answers /v1/* only to a caller with
    a certificate of the cluster CA; the router presents its own (engine_tls) and serves."""
    from harness.procs import cgn_infer

    t = tls(pkidir, "n1-agent")
    sets = ("--set", f"tls.ca_file={t.ca_file}", "--set", f"tls.cert_file={t.cert_file}",
            "--set", f"tls.key_file={t.key_file}")  # fmt: skip
    with cgn_infer(
        tmp_path, "--backend", "sim", "--speed", "50", "--model-name", "m", *sets
    ) as plain_url:
        url = plain_url.replace("http://", "https://")
        trust = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        assert get(url + "/health", trust)[0] == 200  # probes need no certificate
        status, body = get(url + "/v1/models", trust)
        assert status == 403 and "client certificate" in body["error"]["message"]
        n2 = ssl.create_default_context(cafile=str(pkidir / "ca.pem"))
        n2.load_cert_chain(pkidir / "n2-agent.pem", pkidir / "n2-agent.key")
        assert get(url + "/v1/models", n2)[0] == 200
        r = tls(pkidir, "n2-agent")  # the router's identity
        config = {
            "discovery": "static",
            "endpoints": {"e1": {"url": url, "model": "m", "engine": "cgn-infer"}},
            "engine_tls": {"ca_file": str(r.ca_file), "cert_file": str(r.cert_file),
                           "key_file": str(r.key_file)},
        }  # fmt: skip
        with cgn_router(tmp_path, config) as router:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            req = urllib.request.Request(router.url + "/v1/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert json.load(resp)["usage"]["completion_tokens"] == 2


def test_the_agent_launches_cgn_infer_over_https_when_engines_have_a_certificate() -> None:
    from cgn_agent.drivers import DRIVERS, LaunchContext
    from cgn_agent.drivers.base import SystemToolbox
    from cgn_agent.spec import ReplicaId, ReplicaSpec
    from cgn_core.settings import TlsSettings as Tls

    cert = Tls(ca_file=Path("/pki/ca.pem"), cert_file=Path("/pki/n1.pem"), key_file=Path("/k"))
    spec = ReplicaSpec(ReplicaId("r1"), "m", "cgn_infer", "smollm2")
    launch = DRIVERS["cgn_infer"].launch(spec, LaunchContext("10.0.0.5", 8001, tls=cert),
                                         SystemToolbox())  # fmt: skip
    assert launch.url == "https://10.0.0.5:8001"
    assert "tls.cert_file=/pki/n1.pem" in launch.argv and "tls.key_file=/k" in launch.argv
    plain = DRIVERS["cgn_infer"].launch(spec, LaunchContext("10.0.0.5", 8001), SystemToolbox())
    assert plain.url == "http://10.0.0.5:8001" and not any("tls." in a for a in plain.argv)
