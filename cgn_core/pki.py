"""Cognitora's private CA: ECDSA P-256 keys, a CA with path length 0, leaves per node and role.

Every leaf carries the node id as its subject CN and as a DNS SAN, the role as
its OU, and by default both serverAuth and clientAuth usages (a daemon is a
server to some peers and a client of others). `verify` checks a certificate
the way a peer does: signed by our CA, within its validity, with the usage the
connection needs, and (optionally) naming the node id the peer claims; every
refusal says which check failed.

Files (`write_pair`): `<name>.pem` (0644) and `<name>.key` (0600, PKCS#8,
unencrypted: the daemons read it at start), written atomically.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cgn_core.errors import PermanentError
from cgn_core.files import atomic_write_text

ROLES = ("router", "agent", "kvcached", "infer", "metrics", "ctl", "etcd")
Usage = Literal["server", "client", "both"]
CA_DAYS = 3650
LEAF_DAYS = 365
_SKEW = dt.timedelta(minutes=5)  # backdate notBefore: peers' clocks differ a little


class PkiError(PermanentError):
    """A certificate that cannot be issued, read or trusted; the message says why."""


@dataclass(frozen=True, slots=True)
class Pair:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _name(cn: str, ou: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Cognitora"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


_EKUS = {
    "server": [ExtendedKeyUsageOID.SERVER_AUTH],
    "client": [ExtendedKeyUsageOID.CLIENT_AUTH],
    "both": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
}


def _key_usage(*, sign_certs: bool) -> x509.KeyUsage:
    """A CA signs certificates and CRLs; a leaf signs handshakes (ECDHE) and nothing else."""
    return x509.KeyUsage(
        digital_signature=not sign_certs,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not sign_certs,
        key_cert_sign=sign_certs,
        crl_sign=sign_certs,
        encipher_only=False,
        decipher_only=False,
    )


def create_ca(name: str = "Cognitora CA", days: int = CA_DAYS) -> Pair:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(name, "ca")
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(sign_certs=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Pair(key, cert)


def issue(
    ca: Pair,
    node: str,
    role: str,
    sans: Sequence[str] = (),
    days: int = LEAF_DAYS,
    usage: Usage = "both",
    not_before: dt.datetime | None = None,
) -> Pair:
    """A leaf for `node` in `role`: CN and first SAN = node id, extra SANs (DNS names or IPs)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return Pair(key, _leaf(ca, key.public_key(), node, role, sans, days, usage, not_before))


def _leaf(
    ca: Pair,
    public_key: ec.EllipticCurvePublicKey,
    node: str,
    role: str,
    sans: Sequence[str],
    days: int = LEAF_DAYS,
    usage: Usage = "both",
    not_before: dt.datetime | None = None,
) -> x509.Certificate:
    if not node or "/" in node:
        raise PkiError(f"node id {node!r} is not usable as a certificate name")
    if role not in ROLES:
        raise PkiError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if days < 1:
        raise PkiError("validity must be at least one day")
    names: list[x509.GeneralName] = [x509.DNSName(node)]
    for san in sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    ekus = _EKUS[usage]
    start = not_before or (_now() - _SKEW)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(node, role))
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign_certs=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )


# ---- certificate requests (a joining machine's key never leaves it, #65) ---------------------

MAX_CSR_BYTES = 16 << 10
JOIN_ROLES = ("agent",)  # what a join token may be signed for: a node, never a router or ctl


def request(
    key: ec.EllipticCurvePrivateKey, node: str, role: str, ips: Sequence[str] = ()
) -> bytes:
    """A PEM certificate request for `node` in `role`, signed by `key` (the joining side)."""
    names: list[x509.GeneralName] = [x509.DNSName(node)]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_name(node, role))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def sign_request(ca: Pair, csr_pem: bytes, node: str, days: int = LEAF_DAYS) -> x509.Certificate:
    """A node certificate for a joining machine's request, or PkiError saying what is wrong:
    too big or not a request; a forged signature; a key other than ECDSA P-256; a name other
    than `node` (the id its token was spent for); a role other than a node's; a SAN other
    than the node id or an IP address."""
    if len(csr_pem) > MAX_CSR_BYTES:
        raise PkiError(f"the certificate request is over {MAX_CSR_BYTES} bytes")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise PkiError("not a PEM certificate request") from None
    try:  # NOTE: a request that parses may still hold a key or signature that does not
        valid, key = csr.is_signature_valid, csr.public_key()
    except ValueError as exc:
        raise PkiError(f"the certificate request is damaged ({exc})") from None
    if not valid:
        raise PkiError("the certificate request's signature does not verify")
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise PkiError("the certificate request's key must be ECDSA P-256")
    cn = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = csr.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(cn) != 1 or cn[0].value != node:
        raise PkiError(f"the certificate request must name node {node!r}, and only it")
    role = ou[0].value if len(ou) == 1 else ""
    if role not in JOIN_ROLES:
        raise PkiError(f"a join signs node certificates only (role agent), not {role!r}")
    ips: list[str] = []
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([])
    for name in san:
        if isinstance(name, x509.IPAddress):
            ips.append(str(name.value))
        elif not (isinstance(name, x509.DNSName) and name.value == node):
            raise PkiError(
                f"the certificate request may name the node id and IPs only, not {name.value!r}"
            )
    return _leaf(ca, key, node, str(role), ips, days)


# ---- files ----------------------------------------------------------------------------------


def to_pem(pair: Pair) -> tuple[str, str]:
    """(certificate, PKCS#8 key) as PEM text."""
    key_pem = pair.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return pair.cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem


def from_pem(cert_pem: bytes, key_pem: bytes, where: str) -> Pair:
    """A pair from PEM bytes (a Kubernetes Secret's, say); PkiError names `where`."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
    except ValueError:
        raise PkiError(f"{where}: not a PEM certificate and key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{where}: not an ECDSA key")
    return Pair(key, cert)


def write_pair(directory: Path, name: str, pair: Pair) -> tuple[Path, Path]:
    cert_pem, key_pem = to_pem(pair)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    atomic_write_text(key_path, key_pem, mode=0o600)
    atomic_write_text(cert_path, cert_pem)
    return cert_path, key_path


def load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise PkiError(f"{path}: {exc.strerror}") from None
    except ValueError:
        raise PkiError(f"{path}: not a PEM certificate") from None


def load_pair(directory: Path, name: str) -> Pair:
    cert = load_cert(directory / f"{name}.pem")
    try:
        key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
    except OSError as exc:
        raise PkiError(f"{directory / (name + '.key')}: {exc.strerror}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{directory / (name + '.key')}: not an ECDSA key")
    return Pair(key, cert)


# ---- reading and checking ---------------------------------------------------------------------


def common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def _ext(cert: x509.Certificate, kind: type[x509.ExtensionType]) -> x509.ExtensionType | None:
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None


def verify(
    cert: x509.Certificate,
    ca: x509.Certificate,
    *,
    usage: Literal["server", "client"] | None = None,
    node: str | None = None,
    now: dt.datetime | None = None,
) -> None:
    """Raise PkiError naming the first check `cert` fails as a peer certificate under `ca`."""
    when = now or _now()
    cn = common_name(cert)
    if cert.issuer != ca.subject:
        raise PkiError(f"certificate {cn!r} was not issued by this cluster's CA ({_cn(ca)})")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        raise PkiError(f"certificate {cn!r}: signature does not verify against the CA") from None
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if when < start:
        raise PkiError(f"certificate {cn!r} is not valid before {start:%Y-%m-%d %H:%M} UTC")
    if when > end:
        raise PkiError(f"certificate {cn!r} expired on {end:%Y-%m-%d %H:%M} UTC")
    if usage is not None:
        eku = _ext(cert, x509.ExtendedKeyUsage)
        if not isinstance(eku, x509.ExtendedKeyUsage) or _EKUS[usage][0] not in eku:
            raise PkiError(f"certificate {cn!r} is not valid for {usage} authentication")
    if node is not None and cn != node:
        raise PkiError(f"certificate CN {cn!r} does not match the claimed node id {node!r}")


def _cn(cert: x509.Certificate) -> str:
    return common_name(cert) or cert.subject.rfc4514_string()


def key_hash(cert: x509.Certificate) -> str:
    """`sha256:<hex>` of the certificate's public key (SubjectPublicKeyInfo, DER): of the CA,
    what a joining machine pins, as kubeadm's `--discovery-token-ca-cert-hash` (the same
    for every certificate of that key)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def describe(cert: x509.Certificate, ca: x509.Certificate | None = None) -> dict[str, object]:
    """What `cgn-ctl pki inspect` prints: subject, SANs, validity, usages, and the chain check."""
    san = _ext(cert, x509.SubjectAlternativeName)
    ku = _ext(cert, x509.KeyUsage)
    eku = _ext(cert, x509.ExtendedKeyUsage)
    bc = _ext(cert, x509.BasicConstraints)
    pub = cert.public_key()
    usages = []
    if isinstance(ku, x509.KeyUsage):
        for attr in ("digital_signature", "key_agreement", "key_cert_sign", "crl_sign"):
            if getattr(ku, attr):
                usages.append(attr)
    ekus = [o._name for o in eku] if isinstance(eku, x509.ExtendedKeyUsage) else []
    is_ca = isinstance(bc, x509.BasicConstraints) and bc.ca
    doc: dict[str, object] = {
        "subject": cert.subject.rfc4514_string(),
        "common_name": common_name(cert),
        "issuer": cert.issuer.rfc4514_string(),
        "serial": format(cert.serial_number, "x"),
        "sans": [str(n.value) for n in san] if isinstance(san, x509.SubjectAlternativeName) else [],
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "days_left": (cert.not_valid_after_utc - _now()).days,
        "is_ca": is_ca,
        "path_length": bc.path_length if isinstance(bc, x509.BasicConstraints) else None,
        "key_usage": usages,
        "extended_key_usage": ekus,
        "key": f"ECDSA {pub.curve.name}" if isinstance(pub, ec.EllipticCurvePublicKey) else "other",
        "key_hash": key_hash(cert),  # of a CA: what `up --join --ca-hash` pins (#65)
    }
    if ca is not None:
        try:
            if not is_ca:
                verify(cert, ca)
            elif cert.subject != ca.subject:
                raise PkiError("a different CA")
            doc["chain"] = "ok"
        except PkiError as exc:
            doc["chain"] = f"FAILED: {exc.message}"
    return doc
