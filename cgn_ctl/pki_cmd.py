"""`cgn-ctl pki`: bootstrap a private CA, issue, inspect and rotate certificates.

Layout of a PKI directory: `ca.pem` / `ca.key`, and one `<node>-<role>.pem` /
`.key` pair per leaf; keys are 0600 and the directory 0700. Nothing is ever
overwritten silently: an existing CA or leaf is kept unless `--force`, and a
replaced CA is first copied to `ca.pem.<UTC time>.bak` (with its key).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509

from cgn_core import pki
from cgn_core.cli import EXIT_USAGE, fail
from cgn_core.etcd import EtcdClient
from cgn_ctl.options import Config, Etcd, with_etcd

app = typer.Typer(help="The cluster's private CA and certificates.", no_args_is_help=True)

Dir = Annotated[Path, typer.Option("--dir", help="The PKI directory.", envvar="CGN_CTL_PKI_DIR")]
DEFAULT_DIR = Path.home() / ".local/state/cognitora/pki"


def _prepare(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)


def _ca(directory: Path) -> pki.Pair:
    try:
        return pki.load_pair(directory, "ca")
    except pki.PkiError as exc:
        fail(f"no CA in {directory} ({exc.message}); run `cgn-ctl pki bootstrap` first")


def _issue_file(
    directory: Path,
    ca: pki.Pair,
    node: str,
    role: str,
    sans: list[str],
    days: int,
    usage: pki.Usage,
    force: bool,
) -> tuple[Path, bool]:
    name = f"{node}-{role}"
    path = directory / f"{name}.pem"
    if path.exists() and not force:
        return path, False
    try:
        pair = pki.issue(ca, node, role, sans, days, usage)
    except pki.PkiError as exc:
        fail(exc.message, EXIT_USAGE)
    pki.write_pair(directory, name, pair)
    return path, True


@app.command()
def bootstrap(
    directory: Dir = DEFAULT_DIR,
    node: Annotated[
        list[str] | None, typer.Option("--node", help="Node ids to issue leaves for (repeatable).")
    ] = None,
    role: Annotated[
        list[str] | None,
        typer.Option("--role", help="Roles per node (default: router, agent, ctl)."),
    ] = None,
    days: Annotated[int, typer.Option("--days", help="Leaf validity in days.")] = pki.LEAF_DAYS,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace an existing CA (kept as a .bak copy) and leaves."),
    ] = False,
) -> None:
    """Create the CA (if there is none) and a leaf per --node and --role. Idempotent."""
    _prepare(directory)
    ca_path = directory / "ca.pem"
    if ca_path.exists() and not force:
        ca = _ca(directory)
        typer.echo(f"CA {ca_path} exists: kept (--force replaces it)")
    else:
        if ca_path.exists():
            stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
            for ext in ("pem", "key"):
                shutil.copy2(directory / f"ca.{ext}", directory / f"ca.{ext}.{stamp}.bak")
            typer.echo(f"old CA kept as ca.pem.{stamp}.bak")
        ca = pki.create_ca()
        pki.write_pair(directory, "ca", ca)
        typer.echo(f"CA created: {ca_path}")
    for n in node or []:
        for r in role or ["router", "agent", "ctl"]:
            path, made = _issue_file(directory, ca, n, r, [], days, "both", force)
            typer.echo(f"{'issued' if made else 'kept'} {path}")


@app.command("issue")
def issue_cmd(
    node: Annotated[
        str, typer.Option("--node", help="The node id: the certificate's CN and first SAN.")
    ],
    role: Annotated[str, typer.Option("--role", help=f"One of {', '.join(pki.ROLES)}.")],
    san: Annotated[
        list[str] | None, typer.Option("--san", help="Another DNS name or IP (repeatable).")
    ] = None,
    days: Annotated[int, typer.Option("--days", help="Validity in days.")] = pki.LEAF_DAYS,
    usage: Annotated[str, typer.Option("--usage", help="both | server | client.")] = "both",
    directory: Dir = DEFAULT_DIR,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing leaf.")] = False,
) -> None:
    """Issue one leaf certificate signed by the CA in --dir."""
    if usage not in ("both", "server", "client"):
        fail("--usage must be both, server or client", EXIT_USAGE)
    ca = _ca(directory)
    path, made = _issue_file(directory, ca, node, role, san or [], days, usage, force)  # type: ignore[arg-type]
    if not made:
        fail(f"{path} exists (--force replaces it)", EXIT_USAGE)
    typer.echo(f"issued {path}")


@app.command()
def inspect(
    file: Annotated[Path, typer.Argument(help="A PEM certificate.")],
    ca: Annotated[
        Path | None,
        typer.Option("--ca", help="CA to check the chain against (default: ca.pem beside FILE)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Subject, SANs, validity, key usage and the chain check of a certificate."""
    try:
        cert = pki.load_cert(file)
        ca_file = ca or file.parent / "ca.pem"
        ca_cert = pki.load_cert(ca_file) if ca or ca_file.exists() else None
    except pki.PkiError as exc:
        fail(exc.message)
    doc = pki.describe(cert, ca_cert)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    for key, value in doc.items():
        shown = ", ".join(map(str, value)) if isinstance(value, list) else value
        typer.echo(f"{key:20} {shown}")


@app.command()
def rotate(
    directory: Dir = DEFAULT_DIR,
    within: Annotated[
        int, typer.Option("--within", help="Re-issue leaves expiring within this many days.")
    ] = 30,
    all_: Annotated[bool, typer.Option("--all", help="Re-issue every leaf.")] = False,
    days: Annotated[
        int, typer.Option("--days", help="Validity of the new leaves.")
    ] = pki.LEAF_DAYS,
) -> None:
    """Re-issue leaves (new keys; same node, role, SANs and usages) that expire soon, or --all."""
    ca = _ca(directory)
    horizon = dt.datetime.now(dt.UTC) + dt.timedelta(days=within)
    done = 0
    for path in sorted(directory.glob("*.pem")):
        if path.name == "ca.pem":
            continue
        cert = pki.load_cert(path)
        if not all_ and cert.not_valid_after_utc > horizon:
            continue
        node, role, sans, usage = _leaf_params(cert)
        pair = pki.issue(ca, node, role, sans, days, usage)
        pki.write_pair(directory, path.stem, pair)
        typer.echo(f"re-issued {path} (until {pair.cert.not_valid_after_utc:%Y-%m-%d})")
        done += 1
    if not done:
        typer.echo(f"nothing expires within {within} days (--all re-issues every leaf)")


def _leaf_params(cert: x509.Certificate) -> tuple[str, str, list[str], pki.Usage]:
    doc = pki.describe(cert)
    node = str(doc["common_name"])
    ou = cert.subject.get_attributes_for_oid(x509.oid.NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = str(ou[0].value) if ou else "agent"
    sans = [s for s in doc["sans"] if s != node]  # type: ignore[attr-defined]
    ekus = set(doc["extended_key_usage"])  # type: ignore[call-overload]
    usage: pki.Usage = (
        "both" if len(ekus) == 2 else ("server" if "serverAuth" in ekus else "client")
    )
    return node, role, sans, usage


@app.command()
def rbac(
    node: Annotated[
        list[str] | None,
        typer.Option("--node", help="A node id to give its own role (repeatable)."),
    ] = None,
    router: Annotated[
        list[str] | None,
        typer.Option("--router", help="A node id whose certificate runs a router (repeatable)."),
    ] = None,
    admin: Annotated[
        list[str] | None,
        typer.Option("--admin", help="An operator's certificate CN to make root (repeatable)."),
    ] = None,
    metrics: Annotated[
        list[str] | None,
        typer.Option("--metrics", help="A node id whose certificate runs cgn-metrics."),
    ] = None,
    no_enable: Annotated[
        bool, typer.Option("--no-enable", help="Create roles and users, leave auth off.")
    ] = False,
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Confine each certificate to its own keys in etcd (roles per node, routers, operators),
    then switch etcd's auth on. etcd must run with --client-cert-auth; call this with a `root`
    certificate (`cgn-ctl pki issue --node root --role ctl`) in cgn-ctl's etcd.tls settings.
    Idempotent: run it again with more --node to add nodes."""
    from cgn_core import rbac as rbac_plan
    from cgn_core.etcd.auth import apply_plan

    plan = rbac_plan.plan(node or [], router or [], admin or [], metrics or [])
    with_etcd(etcd, config, lambda c: apply_plan(c, plan, enable=not no_enable))
    for user, roles in sorted(plan.users.items()):
        typer.echo(f"{user}: {', '.join(roles)}")
    typer.echo("etcd auth enabled" if not no_enable else "roles and users created; auth is off")


@app.command()
def revoke(
    node: Annotated[str, typer.Argument(help="The node (certificate CN) to revoke.")],
    directory: Dir = DEFAULT_DIR,
    reason: Annotated[str, typer.Option("--reason", help="Kept with the revocation.")] = "",
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Revoke every certificate of NODE in the PKI directory, and the one it joined with
    (`up --join`): their serials go on the deny-list
    in etcd that every Cognitora TLS listener checks, and NODE's etcd user (RBAC) is deleted so
    etcd refuses it too. Issue the node new certificates to let it back in."""
    import contextlib
    import re
    import time

    from cgn_core import keys
    from cgn_core.errors import NotFound
    from cgn_core.etcd import EtcdError
    from cgn_core.etcd.auth import delete_user
    from cgn_core.revocation import normal_serial

    serials = []
    for path in sorted(directory.glob("*.pem")):  # every leaf whose CN is the node
        if path.name == "ca.pem":
            continue
        cert = pki.load_cert(path)
        if _leaf_params(cert)[0] == node:
            serials.append((path, normal_serial(cert.serial_number)))
    doc = {"node": node, "at_unix": time.time(), "reason": reason}

    async def work(c: EtcdClient) -> bool:
        joined = await c.get_json(keys.JOINS + node)  # a machine that joined (#65): its key
        serial = joined.get("serial") if isinstance(joined, dict) else None  # is not here
        if isinstance(serial, str) and re.fullmatch(r"[0-9a-f]{1,40}", serial):
            serials.append((Path(f"{node} (joined)"), normal_serial(int(serial, 16))))
        if not serials:
            raise NotFound(f"no certificate of node {node!r} in {directory}, and it never joined")
        for _, s in serials:
            await c.put_json(keys.REVOKED + s, doc)
        had = await delete_user(c, node)
        # NOTE: etcd checks no user on a lease's keep-alives: revoking the node's leases
        # removes its records now, and without its user it cannot write them again
        owned = [await c.get(keys.NODES + node), await c.get(keys.KVCACHED + node)]
        for prefix in (keys.REPLICAS, keys.ENDPOINTS):
            owned += (await c.get_prefix(f"{prefix}{node}/"))[0]
        for lease in {kv.lease for kv in owned if kv is not None and kv.lease}:
            with contextlib.suppress(EtcdError):  # expired meanwhile
                await c.lease_revoke(lease)
                leases.append(lease)
        return had

    leases: list[int] = []
    had_user = with_etcd(etcd, config, work)
    for path, serial in serials:
        typer.echo(f"revoked {path.name} (serial {serial})")
    if leases:
        typer.echo(f"{len(leases)} lease(s) of {node!r} revoked: its records are gone")
    typer.echo(f"etcd user {node!r} deleted" if had_user else f"no etcd user {node!r} (RBAC off)")
