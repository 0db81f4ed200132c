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
