"""`cgn-ctl tenants`: each tenant's keys, weight, KV share group, usage and budget (#58).

Usage is what every router published at /cognitora/usage/ (cgn_router/ledger.py),
summed for the current UTC day and month; budgets live at /cognitora/tenants/<tenant>.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cgn_core import keys
from cgn_core.apikeys import ApiKeyError, KeyRecord, parse_record
from cgn_core.budgets import (
    TENANT_NAME,
    Budget,
    BudgetError,
    TenantRecord,
    UsageEntry,
    Used,
    budget,
    exhausted,
    parse_tenant,
    parse_usage,
    period,
    remaining,
    total,
)
from cgn_core.cli import EXIT_USAGE, fail
from cgn_core.etcd import EtcdClient
from cgn_core.terminal import for_terminal
from cgn_ctl.keys_cmd import budget_text
from cgn_ctl.options import (
    Config,
    Etcd,
    JoulesPerDay,
    Json,
    TokensPerDay,
    TokensPerMonth,
    delete_one,
    with_etcd,
)

app = typer.Typer(
    help="Tenants: usage against budgets (list), and budgets (set, delete).",
    no_args_is_help=True,
)


def _parsed(kvs: list[Any], parse: Any) -> list[Any]:
    out = []
    for kv in kvs:
        try:
            out.append(parse(kv))
        except (ApiKeyError, BudgetError, ValueError):
            continue  # a bad record is the routers' to skip (and log), not ours to trip on
    return out


async def _read(c: EtcdClient) -> tuple[list[KeyRecord], list[TenantRecord], list[UsageEntry]]:
    key_kvs, _ = await c.get_prefix(keys.API_KEYS)
    tenant_kvs, _ = await c.get_prefix(keys.TENANTS)
    usage_kvs, _ = await c.get_prefix(keys.USAGE)
    return (
        _parsed(key_kvs, lambda kv: parse_record(kv.json())),
        _parsed(tenant_kvs, lambda kv: parse_tenant(kv.json(), kv.key[len(keys.TENANTS) :])),
        _parsed(usage_kvs, lambda kv: parse_usage(kv.json(), kv.key[len(keys.USAGE) :])),
    )


def tenant_rows(
    key_records: list[KeyRecord],
    tenants: list[TenantRecord],
    usage: list[UsageEntry],
    now_unix: float,
) -> list[dict[str, Any]]:
    """One row per tenant named by a key, a budget or a usage record (pure: for the tests)."""
    p = period(now_unix)
    used = total(usage, p)
    budgets = {t.tenant: t.budget for t in tenants}
    scopes = {t for t in used if not t.startswith("@")}  # "@<key id>": a key's own count
    names = sorted({k.tenant for k in key_records} | set(budgets) | scopes)
    rows = []
    for name in names:
        mine = [k for k in key_records if k.tenant == name]
        b, u = budgets.get(name, Budget()), used.get(name, Used())
        hit = exhausted(b, u, p)
        rows.append(
            {
                "tenant": name,
                "keys": len(mine),
                "weights": sorted({k.weight for k in mine}),
                "kv_share_groups": sorted({k.kv_share_group for k in mine if k.kv_share_group}),
                "used": {
                    "tokens_today": u.tokens_day,
                    "tokens_this_month": u.tokens_month,
                    "joules_today": u.joules_day,
                },
                "budget": b.to_json(),
                "remaining": remaining(b, u),
                "exhausted": None
                if hit is None
                else {"budget": hit.what, "resets_unix": hit.resets_unix},
            }
        )
    return rows


@app.command("list")
def list_cmd(etcd: Etcd = None, config: Config = None, as_json: Json = False) -> None:
    """Every tenant: keys, weights, KV share groups, tokens and joules used today and this
    month (UTC, summed over every router), budgets and what is left of them."""

    async def work(c: EtcdClient) -> list[dict[str, Any]]:
        return tenant_rows(*(await _read(c)), time.time())

    rows = with_etcd(etcd, config, work)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table("tenant", "keys", "weight", "kv group", "tokens today", "this month",
              "joules today", "budget", "state")  # fmt: skip
    for r in for_terminal(rows):
        u, limits = r["used"], budget_text(r["budget"])
        state = "ok" if r["exhausted"] is None else f"exhausted ({r['exhausted']['budget']})"
        t.add_row(
            r["tenant"],
            str(r["keys"]),
            ",".join(f"{w:g}" for w in r["weights"]) or "-",
            ",".join(r["kv_share_groups"]) or "-",
            f"{u['tokens_today']:.0f}",
            f"{u['tokens_this_month']:.0f}",
            f"{u['joules_today']:.1f}",
            limits,
            state if limits != "-" else "-",
        )
    Console().print(t if rows else "no tenants")


@app.command("set")
def set_cmd(
    tenant: Annotated[str, typer.Argument(help="The tenant (as its API keys name it).")],
    tokens_per_day: TokensPerDay = None,
    tokens_per_month: TokensPerMonth = None,
    joules_per_day: JoulesPerDay = None,
    note: Annotated[str, typer.Option("--note", help="Free text kept with the tenant.")] = "",
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """Set a tenant's budget (what is not given has no limit). Past it, the routers answer
    429 `budget_exhausted` with the time it resets, within about a second on every router."""
    if not TENANT_NAME.match(tenant):
        fail(f"tenant {tenant!r}: use 1-64 of [A-Za-z0-9._-]", EXIT_USAGE)
    try:  # NOTE: checked before etcd is reached
        record = TenantRecord(
            tenant, budget(tokens_per_day, tokens_per_month, joules_per_day), note
        )
    except BudgetError as exc:
        fail(str(exc), EXIT_USAGE)

    async def work(c: EtcdClient) -> dict[str, Any]:
        key_records, tenants, _ = await _read(c)
        for other in {k.tenant for k in key_records} | {t.tenant for t in tenants}:
            if other != tenant and other.casefold() == tenant.casefold():
                raise ApiKeyError(
                    f"tenant {tenant!r} differs from the existing {other!r} only in case: "
                    f"use {other!r}"
                )
        await c.put_json(keys.TENANTS + tenant, record.to_json())
        return record.to_json()

    doc = with_etcd(etcd, config, work)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(f"tenant {tenant}: budget set" if not record.budget.empty else
                   f"tenant {tenant}: no budget")  # fmt: skip


@app.command("delete")
def delete_cmd(
    tenant: Annotated[str, typer.Argument(help="The tenant whose budget to remove.")],
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Remove a tenant's budget (its keys and its usage stay)."""

    delete_one(etcd, config, keys.TENANTS + tenant, f"tenant record {tenant!r}")
    typer.echo(f"tenant {tenant}: budget removed")
