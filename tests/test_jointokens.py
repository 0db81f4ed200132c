"""Join tokens (#65, the store): created, spent atomically against a real etcd, refused with
the reason, and listed and revoked by `cgn-ctl tokens`."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from cgn_core import pki
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from cgn_core.jointokens import MAX_TTL_S, TokenError, consume, create, parse, token_hash

pytestmark = pytest.mark.etcd
CTL = str(Path(sys.executable).parent / "cgn-ctl")


async def stored(etcd: EtcdClient, prefix: str, **kw: object) -> str:
    token, record = create(**kw)  # type: ignore[arg-type]
    await etcd.put_json(prefix + record.id, record.to_json())
    return token


async def test_a_single_use_token_joins_one_machine_and_says_why_it_refuses(
    etcd: EtcdClient, prefix: str
) -> None:
    token = await stored(etcd, prefix)
    spent = await consume(etcd, token, prefix=prefix)
    assert (spent.used, spent.uses) == (1, 1) and spent.hash == token_hash(token)
    with pytest.raises(TokenError, match="is used up"):
        await consume(etcd, token, prefix=prefix)
    wrong = token[:-1] + ("a" if token[-1] != "a" else "b")
    unknown = "zzzzzz." + token.split(".")[1]
    for bad in (wrong, unknown):
        with pytest.raises(TokenError, match="unknown, revoked or wrong"):
            await consume(etcd, bad, prefix=prefix)
    with pytest.raises(TokenError, match="malformed"):
        await consume(etcd, "not-a-token", prefix=prefix)
    old = await stored(etcd, prefix, ttl_s=60, now_unix=1000.0)
    with pytest.raises(TokenError, match="is expired"):
        await consume(etcd, old, now_unix=1060.0, prefix=prefix)
    await etcd.put(prefix + old.split(".")[0], b"{not json")
    with pytest.raises(TokenError, match="not JSON"):
        await consume(etcd, old, prefix=prefix)


async def test_machines_racing_for_a_token_spend_exactly_its_uses(
    etcd: EtcdClient, prefix: str
) -> None:
    token = await stored(etcd, prefix, uses=3)
    results = await asyncio.gather(
        *(consume(etcd, token, prefix=prefix) for _ in range(8)), return_exceptions=True
    )
    won = [r for r in results if not isinstance(r, BaseException)]
    assert sorted(r.used for r in won) == [1, 2, 3]  # each use once, none twice
    assert all(isinstance(r, TokenError) for r in results if isinstance(r, BaseException))


def test_bad_figures_and_records_are_refused_naming_the_field() -> None:
    for kw, why in [({"ttl_s": 0}, "ttl"), ({"ttl_s": math.nan}, "ttl"),
                    ({"ttl_s": MAX_TTL_S + 1}, "ttl"), ({"uses": 0}, "uses"),
                    ({"uses": 10**6}, "uses"), ({"note": "x" * 300}, "note")]:  # fmt: skip
        with pytest.raises(TokenError, match=why):
            create(**kw)  # type: ignore[arg-type]
    _, record = create()
    assert parse(json.loads(json.dumps(record.to_json())), record.id) == record
    for change, why in [({"used": 10**400}, "used"), ({"hash": "x"}, "hash"),
                        ({"expires_unix": math.inf}, "expires_unix")]:  # fmt: skip
        with pytest.raises(TokenError, match=why):
            parse({**record.to_json(), **change})
    with pytest.raises(TokenError, match="not this record's"):
        parse(record.to_json(), "other1")


def test_a_cas_key_hash_is_the_same_for_every_certificate_of_its_key() -> None:
    ca = pki.create_ca()
    again = pki.create_ca()
    assert pki.key_hash(ca.cert).startswith("sha256:") and len(pki.key_hash(ca.cert)) == 71
    assert pki.key_hash(ca.cert) != pki.key_hash(again.cert)
    assert pki.describe(ca.cert)["key_hash"] == pki.key_hash(ca.cert)


def test_ctl_creates_lists_and_revokes_tokens(etcd_server: LocalEtcd) -> None:
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CTL, "tokens", *args, "--etcd", etcd_server.endpoint],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    made = ctl("create", "--uses", "2", "--ttl", "600", "--note", "gpu box", "--json")
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert doc["token"].startswith(doc["id"] + ".") and "hash" not in doc
    listed = json.loads(ctl("list", "--json").stdout)
    mine = [t for t in listed if t["id"] == doc["id"]]
    assert mine and mine[0]["uses"] == 2 and "hash" not in mine[0]
    assert doc["token"] not in ctl("list").stdout
    assert ctl("revoke", doc["id"]).returncode == 0
    assert all(t["id"] != doc["id"] for t in json.loads(ctl("list", "--json").stdout))
    gone = ctl("revoke", doc["id"])
    assert gone.returncode == 1 and "no join token" in gone.stderr
    bad = ctl("create", "--ttl", "-5")
    assert bad.returncode == 2 and "ttl must be" in bad.stderr and "Traceback" not in bad.stderr


def test_a_joining_machines_request_is_signed_as_a_node_and_nothing_else() -> None:
    """The joining side's key never leaves it: the CA signs its request only as the node id
    its token was spent for, only in a node's role, only for that id and IPs."""
    ca = pki.create_ca()
    key = ec.generate_private_key(ec.SECP256R1())
    cert = pki.sign_request(ca, pki.request(key, "gpu-02", "agent", ["10.0.0.2"]), "gpu-02")
    pki.verify(cert, ca.cert, usage="client", node="gpu-02")
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    assert pki.describe(cert)["sans"] == ["gpu-02", "10.0.0.2"]
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = bytearray(
        x509.load_pem_x509_csr(pki.request(key, "gpu-02", "agent")).public_bytes(
            serialization.Encoding.DER
        )
    )
    der[-1] ^= 1  # the signature's last byte: it parses, and does not verify
    forged = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    damaged = bytearray(pki.request(key, "gpu-02", "agent"))
    damaged[120] ^= 1  # inside the key's bytes: it parses, and its key does not
    for csr, node, why in [
        (pki.request(key, "gpu-02", "ctl"), "gpu-02", "node certificates only"),
        (pki.request(key, "gpu-02", "router"), "gpu-02", "node certificates only"),
        (pki.request(key, "gpu-03", "agent"), "gpu-02", "must name node 'gpu-02'"),
        (pki.request(rsa_key, "gpu-02", "agent"), "gpu-02", "ECDSA P-256"),  # type: ignore[arg-type]
        (b"-----BEGIN CERTIFICATE REQUEST-----\nnope\n", "gpu-02", "not a PEM"),
        (b"x" * (pki.MAX_CSR_BYTES + 1), "gpu-02", "over"),
    ]:
        with pytest.raises(pki.PkiError, match=why):
            pki.sign_request(ca, csr, node)
    with pytest.raises(pki.PkiError, match="does not verify"):
        pki.sign_request(ca, forged, "gpu-02")
    with pytest.raises(pki.PkiError):  # damaged, or not a request: refused either way
        pki.sign_request(ca, bytes(damaged), "gpu-02")


async def test_a_machine_joins_once_with_a_token_and_nothing_else_gets_in(
    etcd: EtcdClient, prefix: str, tmp_path: Path
) -> None:
    """The join service (real HTTPS on loopback, real etcd) and the joiner: a single-use
    token joins one machine, its record is kept; a reused token, a CA that is not the pinned
    one, a node id already taken and a request for another role are refused, and the last
    three spend nothing."""
    import aiohttp
    from aiohttp import web

    from cgn_core.etcd.auth import delete_user
    from cgn_core.etcd.local import free_port
    from cgn_core.settings import TlsSettings
    from cgn_core.tls import server_ssl_context
    from cgn_ctl.join import JoinError, build_join_app, join

    ca = pki.create_ca()
    pki.write_pair(tmp_path, "join", pki.issue(ca, "first", "ctl", sans=["127.0.0.1"]))
    tls = TlsSettings(cert_file=tmp_path / "join.pem", key_file=tmp_path / "join.key")
    runner = web.AppRunner(build_join_app(etcd, ca, ("127.0.0.1:2379",), root=prefix))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_ssl_context(
        tls, client_cert="none")).start()  # fmt: skip
    url, pinned = f"https://127.0.0.1:{port}", pki.key_hash(ca.cert)

    async def token(uses: int = 1) -> tuple[str, str]:
        secret, record = create(uses=uses)
        await etcd.put_json(f"{prefix}tokens/{record.id}", record.to_json())
        return secret, f"{prefix}tokens/{record.id}"

    async def used(where: str) -> int:
        return int((await etcd.get_json(where))["used"])

    try:
        first, _ = await token()
        key, cert, got, endpoints = await join(url, first, pinned, "gpu-02", ("127.0.0.1",))
        pki.verify(cert, ca.cert, usage="server", node="gpu-02")
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
        assert got == ca.cert and pki.describe(cert)["sans"] == ["gpu-02", "127.0.0.1"]
        joined = await etcd.get_json(prefix + "joins/gpu-02")
        assert joined["token"] == first.split(".")[0]
        assert joined["serial"] == format(cert.serial_number, "x")
        assert endpoints == ("127.0.0.1:2379",)  # where the joiner then reaches etcd
        assert await delete_user(etcd, "gpu-02")  # its etcd user was made (removed here)
        with pytest.raises(JoinError, match="used up"):
            await join(url, first, pinned, "gpu-03")
        spare, where = await token()
        with pytest.raises(JoinError, match="not the one pinned"):
            await join(url, spare, pki.key_hash(pki.create_ca().cert), "gpu-04")
        await etcd.put_json(prefix + "nodes/gpu-05", {"engines": []})
        with pytest.raises(JoinError, match="'gpu-05' is taken"):
            await join(url, spare, pinned, "gpu-05")
        with pytest.raises(JoinError, match="'gpu-02' is taken"):
            await join(url, spare, pinned, "gpu-02")
        csr = pki.request(ec.generate_private_key(ec.SECP256R1()), "gpu-06", "ctl").decode()
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                url + "/v1/join", json={"token": spare, "node": "gpu-06", "csr": csr}, ssl=False
            ) as r,
        ):
            assert r.status == 403 and "node certificates only" in (await r.text())
        assert await used(where) == 0  # none of the three refusals spent the token
        assert await etcd.get(prefix + "joins/gpu-06") is None
        with pytest.raises(JoinError, match="cannot reach"):
            await join(f"https://127.0.0.1:{free_port()}", spare, pinned, "gpu-07")
    finally:
        await runner.cleanup()


def test_two_commands_join_a_machine_from_the_command_line(
    etcd_server: LocalEtcd, tmp_path: Path
) -> None:
    """`cgn-ctl join-service` where the CA is, `cgn-ctl join` on the joining side: files
    written (the key 0600, made there); a spent token and a CA not pinned are one-line
    errors (exit 1) and write nothing."""
    import os
    import time

    from cgn_core.etcd.local import free_port

    pkidir, out = tmp_path / "pki", tmp_path / "joined"
    pki.write_pair(pkidir, "ca", pki.create_ca())
    ca_cert = pki.load_cert(pkidir / "ca.pem")
    endpoint = ["--etcd", etcd_server.endpoint]
    made = subprocess.run([CTL, "tokens", "create", "--json", *endpoint], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    token = json.loads(made.stdout)["token"]
    port = free_port()
    log = (tmp_path / "service.log").open("w")
    service = subprocess.Popen([CTL, "join-service", "--listen", f"127.0.0.1:{port}", "--dir",
                                str(pkidir), *endpoint], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "ready https://" not in (tmp_path / "service.log").read_text():
            assert service.poll() is None and time.monotonic() < deadline, (
                tmp_path / "service.log"
            ).read_text()
            time.sleep(0.1)
        printed = (tmp_path / "service.log").read_text()
        assert f"--ca-hash {pki.key_hash(ca_cert)}" in printed

        def join(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([CTL, "join", f"https://127.0.0.1:{port}", "--node", "gpu-09",
                                   "--out", str(out), *extra], capture_output=True, text=True,
                                  timeout=60)  # fmt: skip

        done = join("--token", token, "--ca-hash", pki.key_hash(ca_cert), "--ip", "127.0.0.1")
        assert done.returncode == 0, done.stderr
        cert = pki.load_cert(out / "gpu-09.pem")
        pki.verify(cert, pki.load_cert(out / "ca.pem"), usage="client", node="gpu-09")
        assert os.stat(out / "gpu-09.key").st_mode & 0o777 == 0o600
        again = join("--token", token, "--ca-hash", pki.key_hash(ca_cert), "--force")
        assert again.returncode == 1 and "used up" in again.stderr
        assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1
        other = pki.key_hash(pki.create_ca().cert)
        wrong = join("--token", token, "--ca-hash", other, "--force")
        assert wrong.returncode == 1 and "not the one pinned" in wrong.stderr
        assert pki.load_cert(out / "gpu-09.pem") == cert  # nothing rewritten by a refusal
    finally:
        service.terminate()
        service.wait(timeout=10)
        log.close()
