"""`cgn-ctl join-service` and `cgn-ctl join`: a second machine gets its node certificate (#65).

On the machine holding the CA (the PKI directory of `cgn-ctl pki bootstrap`):

    cgn-ctl tokens create                       # prints a token, once
    cgn-ctl join-service --listen 0.0.0.0:7443  # prints the join command to run elsewhere

On the joining machine:

    cgn-ctl join https://HOST:7443 --token TOKEN --ca-hash sha256:... --node gpu-02 \\
        --out /etc/cognitora/pki

writes `ca.pem`, `gpu-02.pem` and `gpu-02.key` (0600, made on this machine) for its agent's
`etcd.tls` and `admin_tls`. What the service checks is in cgn_ctl/join.py. `cgn-ctl up` does
these for you (`up --listen`, `up --join`); these are the two steps by hand.
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
from pathlib import Path
from typing import Annotated

import typer
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from cgn_core import pki
from cgn_core.cli import EXIT_USAGE, fail
from cgn_core.errors import CognitoraError
from cgn_core.etcd import EtcdClient
from cgn_core.files import atomic_write_text
from cgn_core.settings import TlsSettings
from cgn_core.tls import server_ssl_context
from cgn_ctl.join import JoinError, build_join_app, join
from cgn_ctl.options import Config, Etcd, ctl_settings
from cgn_ctl.pki_cmd import DEFAULT_DIR, Dir

SERVICE_NAME = "join-service"  # its certificate's node name, in the PKI directory


def join_service(
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT to serve on (0.0.0.0 for every address).")
    ] = "0.0.0.0:7443",
    advertise: Annotated[
        str,
        typer.Option(
            "--advertise",
            help="The address other machines reach this one at (default: the --listen host).",
        ),
    ] = "",
    directory: Dir = DEFAULT_DIR,
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Serve joins for other machines: each spends a join token (`cgn-ctl tokens create`) for
    one node certificate signed by this machine's CA. Runs until stopped (Ctrl-C)."""
    host, _, port_text = listen.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        fail(f"--listen {listen!r}: want HOST:PORT", EXIT_USAGE)
    port, shown = int(port_text), advertise or host
    try:
        ca = pki.load_pair(directory, "ca")
    except pki.PkiError as exc:
        fail(f"no CA in {directory} ({exc.message}); run `cgn-ctl pki bootstrap` first")
    sans = [a for a in {host, shown} if a not in ("0.0.0.0", "::")]
    own = pki.issue(ca, SERVICE_NAME, "ctl", sans=sans)
    cert_path, key_path = pki.write_pair(directory, SERVICE_NAME, own)
    tls = server_ssl_context(
        TlsSettings(cert_file=cert_path, key_file=key_path), client_cert="none"
    )
    url = f"https://{_bracketed(shown)}:{port}"
    settings = ctl_settings(etcd, config)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with EtcdClient(settings.etcd, patient=True) as client:
            app = build_join_app(client, ca, settings.etcd.endpoints)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, port, ssl_context=tls).start()
            except OSError as exc:
                raise JoinError(f"cannot listen on {listen}: {exc.strerror}") from None
            typer.echo(f"join service on {url}; on another machine run:", err=True)
            typer.echo(f"cgn-ctl join {url} --token TOKEN --ca-hash {pki.key_hash(ca.cert)} "
                       "--node NODE_ID --out /etc/cognitora/pki", err=True)  # fmt: skip
            typer.echo(f"ready {url}", err=True)
            try:
                await stop.wait()
            finally:
                await runner.cleanup()

    try:
        asyncio.run(serve())
    except CognitoraError as exc:
        fail(exc.message)


def join_cmd(
    url: Annotated[str, typer.Argument(help="The join service: https://HOST:PORT.")],
    token: Annotated[str, typer.Option("--token", help="A join token (`cgn-ctl tokens create`).")],
    ca_hash: Annotated[
        str, typer.Option("--ca-hash", help="sha256:... of the cluster's CA, as printed there.")
    ],
    node: Annotated[str, typer.Option("--node", help="This machine's node id.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write ca.pem, NODE.pem, NODE.key.")],
    ip: Annotated[
        list[str] | None, typer.Option("--ip", help="An address of this machine (repeatable).")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a key and certificate already in --out.")
    ] = False,
) -> None:
    """Join this machine to a cluster: make its key here, have its certificate signed with a
    join token, and write them with the cluster's CA (checked against --ca-hash first)."""
    if not url.startswith("https://"):
        fail(f"{url!r}: the join service is HTTPS (https://HOST:PORT)", EXIT_USAGE)
    for address in ip or []:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            fail(f"--ip {address!r} is not an IP address", EXIT_USAGE)
    if (out / f"{node}.key").exists() and not force:
        fail(f"{out / (node + '.key')} exists: this machine has joined (--force replaces it)")
    try:
        key, cert, ca, _ = asyncio.run(join(url.rstrip("/"), token, ca_hash, node, tuple(ip or ())))
    except CognitoraError as exc:
        fail(exc.message)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "ca.pem", ca.public_bytes(serialization.Encoding.PEM).decode())
    cert_path, key_path = pki.write_pair(out, node, pki.Pair(key, cert))
    typer.echo(f"joined as {node}: {cert_path} (key {key_path}, CA {out / 'ca.pem'})")


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
