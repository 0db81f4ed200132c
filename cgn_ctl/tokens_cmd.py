"""`cgn-ctl tokens`: join tokens for new machines (create, list, revoke). Only a hash is stored.

The token itself is printed once, by `create`. What takes a token (a signing endpoint and
`cgn-ctl up --join`, #65) is not built yet: these commands keep the store.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cgn_core import keys
from cgn_core.cli import EXIT_USAGE, fail
from cgn_core.etcd import EtcdClient
from cgn_core.jointokens import DEFAULT_TTL_S, TokenError, create, parse
from cgn_core.terminal import for_terminal
from cgn_ctl.options import Config, Etcd, Json, delete_one, show_once, with_etcd

app = typer.Typer(help="Join tokens for new machines: create, list, revoke.", no_args_is_help=True)


@app.command("create")
def create_cmd(
    ttl: Annotated[
        float, typer.Option("--ttl", help="Seconds until the token expires (at most 30 days).")
    ] = DEFAULT_TTL_S,
    uses: Annotated[int, typer.Option("--uses", help="Machines it may join (1-1000).")] = 1,
    note: Annotated[str, typer.Option("--note", help="Free text kept with the token.")] = "",
    etcd: Etcd = None,
    config: Config = None,
    as_json: Json = False,
) -> None:
    """Create a join token and print it (once: only its hash is stored)."""
    try:  # NOTE: checked before etcd is reached
        token, record = create(ttl, uses, note)
    except TokenError as exc:
        fail(exc.message, EXIT_USAGE)

    async def work(c: EtcdClient) -> None:
        if not await c.put_if_absent(
            keys.TOKENS + record.id, json.dumps(record.to_json()).encode()
        ):
            raise TokenError("a token with that id exists (1 in 2 billion): run it again")

    with_etcd(etcd, config, work)
    headline = f"join token {record.id} ({uses} use{'s' * (uses > 1)}, {ttl:.0f} s):"
    show_once("token", token, record.to_json(), headline, as_json)


@app.command("list")
def list_cmd(etcd: Etcd = None, config: Config = None, as_json: Json = False) -> None:
    """Every join token: id, uses left, expiry, note (never the token or its hash)."""

    async def work(c: EtcdClient) -> list[dict[str, Any]]:
        kvs, _ = await c.get_prefix(keys.TOKENS)
        out = []
        for kv in kvs:
            try:
                record = parse(json.loads(kv.value), kv.key[len(keys.TOKENS) :])
            except (TokenError, ValueError):
                continue  # not ours to trip on: a bad record is refused when it is spent
            doc = record.to_json()
            doc.pop("hash")
            out.append(doc)
        return out

    rows = with_etcd(etcd, config, work)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table("id", "uses left", "expires", "note")
    now = time.time()
    for r in for_terminal(rows):
        left = r["expires_unix"] - now
        t.add_row(r["id"], str(r["uses"] - r["used"]),
                  "expired" if left <= 0 else f"in {int(left)}s", r["note"])  # fmt: skip
    Console().print(t if rows else "no join tokens")


@app.command("revoke")
def revoke_cmd(
    token_id: Annotated[str, typer.Argument(help="The token's id (the part before the dot).")],
    etcd: Etcd = None,
    config: Config = None,
) -> None:
    """Delete a join token: it joins no machine from now on."""

    delete_one(etcd, config, keys.TOKENS + token_id, f"join token {token_id!r}")
    typer.echo(f"join token {token_id} revoked")
