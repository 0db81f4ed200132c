"""What cgn-ctl's commands share: the etcd/config/json options and running one etcd operation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from cgn_control.decide.catalog import CatalogError
from cgn_core.apikeys import ApiKeyError
from cgn_core.cli import EXIT_USAGE, fail, flag, load_service_settings
from cgn_core.errors import CognitoraError, NotFound
from cgn_core.etcd import EtcdClient
from cgn_core.logs import setup_logging
from cgn_core.settings import EtcdSettings, TlsSettings
from cgn_ctl.settings import CtlSettings
from cgn_ctl.upstate import read_record

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")

Etcd = Annotated[
    str | None,
    flag(
        "--etcd",
        "etcd endpoints, comma-separated (default: the one `cgn-ctl up` started, "
        "else 127.0.0.1:2379).",
    ),
]
Config = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML settings file.", envvar="CGN_CTL_CONFIG"),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
StateDir = Annotated[Path | None, flag("--state-dir", "Where `cgn-ctl up` kept its record.")]
# A budget's figures (cgn_core/budgets.py), for a tenant (`tenants set`) or a key (`keys create`)
TokensPerDay = Annotated[
    float | None,
    typer.Option("--tokens-per-day", help="Budget: prompt + completion tokens per UTC day."),
]
TokensPerMonth = Annotated[
    float | None,
    typer.Option("--tokens-per-month", help="Budget: prompt + completion tokens per UTC month."),
]
JoulesPerDay = Annotated[
    float | None,
    typer.Option(
        "--joules-per-day",
        help="Budget: joules per UTC day, where the nodes' energy is measured (cgn-metrics).",
    ),
]


def show_once(
    field: str, secret: str, doc: Mapping[str, Any], headline: str, as_json: bool
) -> None:
    """A new secret (an API key, a join token) printed once with its record, never its hash:
    as JSON under `field`, or `headline` then the secret (the reminder on stderr)."""
    if as_json:
        shown = {k: v for k, v in doc.items() if k != "hash"}
        typer.echo(json.dumps({field: secret, **shown}, indent=2))
    else:
        typer.echo(headline)
        typer.echo(secret)
        typer.echo("store it now: it is not shown again", err=True)


def delete_one(etcd: str | None, config: Path | None, key: str, what: str) -> None:
    """Delete one record (`keys revoke`, `tokens revoke`, `tenants delete`); NotFound (exit 1)
    naming `what` when there is none."""

    async def work(c: EtcdClient) -> None:
        if not await c.delete(key):
            raise NotFound(f"no {what}")

    with_etcd(etcd, config, work)


def ctl_settings(
    etcd: str | None, config: Path | None, state_dir: Path | None = None
) -> CtlSettings:
    """cgn-ctl's settings; with no etcd given anywhere, the one `cgn-ctl up` started (its
    record in `state_dir`, else the settings' state_dir), and for that etcd, its TLS files."""
    flags = {"etcd.endpoints": etcd} if etcd else {}
    settings = load_service_settings(CtlSettings, "ctl", config, flags)
    record = up_record(state_dir, settings)
    found = record.get("etcd") if record else None
    if not (isinstance(found, str) and found):
        return settings
    if not etcd and settings.etcd.endpoints == EtcdSettings().endpoints:
        settings = replace(settings, etcd=replace(settings.etcd, endpoints=(found,)))
    if settings.etcd.endpoints == tuple(found.split(",")):
        settings = _up_tls(settings, record)
    return settings


def up_record(state_dir: Path | None, settings: CtlSettings) -> dict[str, Any] | None:
    """What `cgn-ctl up` recorded (None: nothing, or a damaged record, which `status`
    reports; the defaults apply)."""
    try:
        return read_record(state_dir or settings.state_dir)
    except CognitoraError:
        return None


def root_tls(record: dict[str, Any] | None) -> TlsSettings | None:
    """The `root` client certificate `up` recorded for its TLS cluster (None: none)."""
    files = record.get("etcd_tls") if record else None
    if not isinstance(files, dict):
        return None
    try:
        return TlsSettings(**{k: Path(str(files[k])) for k in ("ca_file", "cert_file", "key_file")})
    except KeyError:
        return None


def read_capped(resp: httpx.Response, limit: int) -> bytes | None:
    """A streamed answer's body, or None as soon as it passes `limit` bytes."""
    body = bytearray()
    for chunk in resp.iter_bytes():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _up_tls(settings: CtlSettings, record: dict[str, Any] | None) -> CtlSettings:
    """With the etcd `up` started (TLS) and no TLS settings of its own, cgn-ctl is that
    cluster's `root` through the certificate `up` recorded."""
    tls = root_tls(record)
    if settings.etcd.tls.enabled or tls is None:
        return settings
    return replace(settings, etcd=replace(settings.etcd, tls=tls))


def with_etcd(
    etcd: str | None,
    config: Path | None,
    work: Callable[[EtcdClient], Awaitable[T]],
    state_dir: Path | None = None,
) -> T:
    """Load settings, open a client, run `work`; errors become one line and an exit code
    (2 for input the catalog or the key store refuses, 1 for everything else)."""
    settings = ctl_settings(etcd, config, state_dir)
    setup_logging("ctl", settings.log)

    async def main() -> T:
        async with EtcdClient(settings.etcd, patient=True) as client:
            return await work(client)

    try:
        return asyncio.run(main())
    except CatalogError as exc:
        fail(str(exc), EXIT_USAGE)
    except ApiKeyError as exc:
        fail(exc.message, EXIT_USAGE)
    except CognitoraError as exc:
        fail(exc.message)
