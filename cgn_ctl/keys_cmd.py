"""`cgn-ctl keys`: API keys (create, list, revoke, rotate). Only a hash of each key is stored.

The key itself is printed once, by `create` and `rotate`; it cannot be shown again.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cgn_core import keys
from cgn_core.apikeys import ApiKeyError, Limits, create, parse_record
from cgn_core.budgets import BudgetError, budget
from cgn_core.cli import EXIT_USAGE, fail
from cgn_core.errors import NotFound
from cgn_core.etcd import EtcdClient
from cgn_core.terminal import for_terminal
from cgn_ctl.options import (
    Config,
    Etcd,
    JoulesPerDay,
    Json,
    TokensPerDay,
    TokensPerMonth,
    ctl_settings,
    delete_one,
    show_once,
    with_etcd,
)

app = typer.Typer(help="API keys: create, list, revoke, rotate.", no_args_is_help=True)


@app.command("create")
def create_cmd(
    tenant: Annotated[
        str, typer.Option("--tenant", help="Who the key belongs to (fairness is per tenant).")
    ],
    band: Annotated[
        str, typer.Option("--band", help="Priority band (router admission.bands).")
    ] = "gold",
    models: Annotated[
        str, typer.Option("--models", help="Comma-separated models the key may use, or *.")
    ] = "*",
    admin: Annotated[bool, typer.Option("--admin", help="May call management APIs.")] = False,
    rps: Annotated[float | None, typer.Option("--rps", help="Requests per second.")] = None,
    tokens_per_min: Annotated[
        int | None, typer.Option("--tokens-per-min", help="Tokens per minute.")
    ] = None,
    concurrent: Annotated[
        int | None, typer.Option("--concurrent", help="Requests in flight at once.")
    ] = None,
    expires_in: Annotated[
        float | None, typer.Option("--expires-in", help="Seconds until the key expires.")
    ] = None,
    note: Annotated[str, typer.Option("--note", help="Free text kept with the key.")] = "",
    kv_share_group: Annotated[
        str,
        typer.Option(
            "--kv-share-group",
            help="Share cached prompts with every key naming this group, whatever its tenant "
            "(default: with the key's own tenant only).",
        ),
    ] = "",
    weight: Annotated[
        float,
        typer.Option(
            "--weight",
            help="The tenant's share of engine work (tokens) within its band against other "
            "tenants waiting there: 2 is served twice what 1 is.",
        ),
    ] = 1.0,
    tokens_per_day: TokensPerDay = None,
    tokens_per_month: TokensPerMonth = None,
    joules_per_day: JoulesPerDay = None,
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """Create a key and print it (once: only its hash is stored). A budget given here is
    the key's own, besides its tenant's (`cgn-ctl tenants set`)."""
    names = tuple(m.strip() for m in models.split(",") if m.strip())
    known = ctl_settings(etcd, config).bands
    if band not in known:
        why = f"band {band!r} is not one of the routers' bands ({', '.join(known)})"
        fail(
            f"{why}; for routers with other admission.bands, list them in the `bands` setting",
            EXIT_USAGE,
        )

    try:  # NOTE: checked before etcd is reached: a mistake costs no connection
        own = budget(tokens_per_day, tokens_per_month, joules_per_day)
        key, record = create(
            tenant,
            band,
            models=names,
            admin=admin,
            limits=Limits(rps, tokens_per_min, concurrent),
            expires_in_s=expires_in,
            note=note,
            kv_share_group=kv_share_group,
            weight=weight,
            budget=own,
        )
    except (ApiKeyError, BudgetError) as exc:
        fail(str(exc), EXIT_USAGE)

    async def work(c: EtcdClient) -> dict[str, Any]:
        kvs, _ = await c.get_prefix(keys.API_KEYS)
        for kv in kvs:
            try:
                other = parse_record(kv.json())
            except (ApiKeyError, ValueError):
                continue  # a bad record is the routers' to skip, not ours to trip on
            for what, mine, theirs in (
                ("tenant", record.tenant, other.tenant),
                ("kv share group", record.kv_share_group, other.kv_share_group),
            ):
                if mine and mine != theirs and mine.casefold() == theirs.casefold():
                    raise ApiKeyError(
                        f"{what} {mine!r} differs from the existing {theirs!r} only in case: "
                        f"use {theirs!r}, or a name that differs in more"
                    )
        await c.put_json(keys.API_KEYS + record.id, record.to_json())
        return record.to_json()

    doc = with_etcd(etcd, config, work)
    _show_new(key, doc, as_json)


def _show_new(key: str, doc: dict[str, Any], as_json: bool) -> None:
    headline = f"key {doc['id']} for tenant {doc['tenant']} (band {doc['band']}):"
    show_once("key", key, doc, headline, as_json)


@app.command("list")
def list_cmd(etcd: Etcd = None, config: Config = None, as_json: Json = False) -> None:
    """Every key: id, tenant, band, models, limits, expiry (never the key or its hash)."""

    async def work(c: EtcdClient) -> list[dict[str, Any]]:
        kvs, _ = await c.get_prefix(keys.API_KEYS)
        out = []
        for kv in kvs:
            doc = parse_record(kv.json()).to_json()
            doc.pop("hash")
            out.append(doc)
        return out

    rows = with_etcd(etcd, config, work)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table(
        "id",
        "tenant",
        "band",
        "models",
        "rps",
        "tokens/min",
        "concurrent",
        "expires",
        "kv group",
        "weight",
        "budget",
    )
    now = time.time()
    for r in for_terminal(rows):
        lim = r["limits"]
        exp = r["expires_unix"]
        expires = "-" if exp is None else ("expired" if exp <= now else f"in {int(exp - now)}s")
        limits = [str(lim[k] or "-") for k in ("rps", "tokens_per_min", "concurrent")]
        group = r["kv_share_group"] or "-"
        row = [r["id"], r["tenant"], r["band"], ",".join(r["models"]), *limits, expires, group]
        t.add_row(*row, f"{r['weight']:g}", budget_text(r["budget"]))
    Console().print(t if rows else "no keys")


def budget_text(doc: dict[str, Any]) -> str:
    """A budget's figures, short: "2e+06 tok/day, 50 J/day" ("-": none)."""
    parts = [
        f"{doc[k]:g} {label}"
        for k, label in (
            ("tokens_per_day", "tok/day"),
            ("tokens_per_month", "tok/month"),
            ("joules_per_day", "J/day"),
        )
        if doc.get(k) is not None
    ]
    return ", ".join(parts) or "-"


@app.command("revoke")
def revoke_cmd(
    key_id: Annotated[str, typer.Argument(help="The key's id.")],
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Delete a key: routers refuse it within seconds (they watch the keys)."""

    delete_one(etcd, config, keys.API_KEYS + key_id, f"key {key_id!r}")
    typer.echo(f"key {key_id} revoked")


@app.command("rotate")
def rotate_cmd(
    key_id: Annotated[str, typer.Argument(help="The key to replace.")],
    grace: Annotated[
        float, typer.Option("--grace", help="Seconds the old key keeps working.")
    ] = 0.0,
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """A new key with the old one's tenant, band, models, limits, KV share group, weight and
    budget (whose count starts afresh); the old ends after --grace."""

    async def work(c: EtcdClient) -> tuple[str, dict[str, Any]]:
        raw = await c.get_json(keys.API_KEYS + key_id)
        if raw is None:
            raise NotFound(f"no key {key_id!r}")
        old = parse_record(raw)
        key, record = create(
            old.tenant,
            old.band,
            models=old.models,
            admin=old.admin,
            limits=old.limits,
            note=old.note,
            kv_share_group=old.kv_share_group,
            weight=old.weight,
            budget=old.budget,
        )
        await c.put_json(keys.API_KEYS + record.id, record.to_json())
        if grace > 0:
            await c.put_json(
                keys.API_KEYS + key_id, {**old.to_json(), "expires_unix": time.time() + grace}
            )
        else:
            await c.delete(keys.API_KEYS + key_id)
        return key, record.to_json()

    key, doc = with_etcd(etcd, config, work)
    _show_new(key, doc, as_json)
