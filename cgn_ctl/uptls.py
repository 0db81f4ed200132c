"""The certificates `cgn-ctl up` gives the processes it starts (#65): TLS by default.

`up` keeps a private CA in `<state_dir>/pki` (made on the first start, kept after) and one
leaf per identity, each named as docs/security.md describes (subject CN = the node id, OU =
the role):

    etcd.pem            CN etcd: etcd's own serving certificate
    root.pem            CN root, client only: `up` itself and later cgn-ctl commands (etcd root)
    <node>-agent.pem    each agent: its etcd user, its admin listener, its engines and KV store
    <node>-router.pem   the router: its etcd user (role cgn-router), the OpenAI port, its admin
                        listener, and the client certificate it shows engines
    <node>-metrics.pem  cgn-metrics: its etcd user (role cgn-metrics), scraping HTTPS targets

A leaf is issued again when it is missing, expires within 30 days, or does not name an
address the cluster now listens on (`--listen` moved); otherwise it is kept, so a restart
changes nothing. Every leaf names 127.0.0.1 and localhost, and the listen address.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cgn_core import pki
from cgn_core.settings import TlsSettings

LOOPBACK = ("127.0.0.1", "localhost")
RENEW_WITHIN = dt.timedelta(days=30)
ROOT = "root"


@dataclass(frozen=True, slots=True)
class UpPki:
    """Where `up`'s certificates are, by identity."""

    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def leaf(self, name: str) -> TlsSettings:
        """The CA, and `name`'s certificate and key (etcd, root, <node>-<role>)."""
        d = self.directory
        return TlsSettings(
            ca_file=d / "ca.pem", cert_file=d / f"{name}.pem", key_file=d / f"{name}.key"
        )

    def ca_hash(self) -> str:
        return pki.key_hash(pki.load_cert(self.ca_file))


def prepare(
    directory: Path, nodes: Sequence[str], hosts: Iterable[str] = (), router: bool = True
) -> UpPki:
    """The CA (made if there is none) and every leaf `up` needs for `nodes` (the first also
    runs the router and cgn-metrics, unless not `router`: a joining machine's agent), naming
    `hosts` besides loopback."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    try:
        ca = pki.load_pair(directory, "ca")
    except pki.PkiError:
        if (directory / "ca.pem").exists():
            raise  # NOTE: a damaged CA is the user's to look at; never silently replaced
        ca = pki.create_ca()
        pki.write_pair(directory, "ca", ca)
    sans = list(dict.fromkeys([*LOOPBACK, *hosts]))
    wanted: list[tuple[str, str, str, pki.Usage]] = []
    if router:
        wanted += [("etcd", "etcd", "etcd", "both"), (ROOT, ROOT, "ctl", "client")]
        wanted += [(f"{nodes[0]}-router", nodes[0], "router", "both")]
        wanted += [(f"{nodes[0]}-metrics", nodes[0], "metrics", "both")]
    wanted += [(f"{n}-agent", n, "agent", "both") for n in nodes]
    for name, node, role, usage in wanted:
        if not _current(directory / f"{name}.pem", ca, sans):
            pki.write_pair(directory, name, pki.issue(ca, node, role, sans, usage=usage))
    return UpPki(directory)


def _current(path: Path, ca: pki.Pair, sans: Sequence[str]) -> bool:
    """Whether the leaf at `path` is from `ca`, valid beyond RENEW_WITHIN and names `sans`."""
    if not path.exists() or not path.with_suffix(".key").exists():
        return False
    try:
        cert = pki.load_cert(path)
        pki.verify(cert, ca.cert)
    except pki.PkiError:
        return False
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < RENEW_WITHIN:
        return False
    named = {str(n) for n in pki.describe(cert)["sans"]}  # type: ignore[attr-defined]
    return all(_shown(s) in named for s in sans)


def _shown(san: str) -> str:
    """A SAN as pki.describe shows it (IP addresses normalized)."""
    try:
        return str(ipaddress.ip_address(san))
    except ValueError:
        return san


def sets(prefix: str, tls: TlsSettings, *, ca: bool = True) -> list[str]:
    """`--set` flags giving a daemon's `prefix` (etcd.tls, admin_tls, ...) these files."""
    files = {"ca_file": tls.ca_file if ca else None, "cert_file": tls.cert_file,
             "key_file": tls.key_file}  # fmt: skip
    return [a for k, v in files.items() if v is not None for a in ("--set", f"{prefix}.{k}={v}")]


def as_json(tls: TlsSettings) -> dict[str, str]:
    """The settings' files, for a YAML/JSON config or the up record."""
    files = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}
    return {k: str(v) for k, v in files.items() if v is not None}
