"""Rich tables for cgn-ctl's human output (`--json` prints the same data raw)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


def nodes(rows: list[dict[str, Any]]) -> None:
    t = Table("node", "state", "class", "devices", "unhealthy", "engines", "replicas", "watts")
    for r in rows:
        sick = "; ".join(f"#{u['index']}: {u['why']}" for u in r["unhealthy"]) or "-"
        watts = "-" if r["watts"] is None else f"{r['watts']:.0f}"
        t.add_row(
            r["node"],
            r["state"],
            r["class"],
            str(r["accelerators"]),
            sick,
            ", ".join(r["engines"]),
            str(len(r["replicas"])),
            watts,
        )
    console.print(t if rows else "no nodes registered")


def models(rows: list[dict[str, Any]]) -> None:
    t = Table(
        "model",
        "replicas (ready/placed/target, min–max)",
        "profiles",
        "aliases",
        "fallbacks",
        "managed by",
    )
    for r in rows:
        t.add_row(
            r["model"],
            f"{r['ready']}/{r['placed']}/{'-' if r.get('desired') is None else r['desired']}, "
            f"{r['min']}–{r['max']}",
            ", ".join(r["profiles"]),
            ", ".join(r["aliases"]) or "-",
            ", ".join(r["fallbacks"]) or "-",
            r.get("managed_by") or "cgn-ctl",
        )
    console.print(t if rows else "the catalog is empty")


def replicas(rows: list[dict[str, Any]]) -> None:
    t = Table(
        "replica",
        "model",
        "role",
        "node",
        "part",
        "engine",
        "devices",
        "phase",
        "restarts",
        "adapters",
        "reason",
    )
    for r in rows:
        node = r["node"] if r["node_state"] == "ready" else f"{r['node']} ({r['node_state']})"
        t.add_row(
            r["replica"],
            str(r["model"]),
            r["role"],
            node,
            r.get("part") or "-",
            str(r["engine"]),
            ",".join(map(str, r["devices"])) or "-",
            r["phase"],
            str(r["restarts"]),
            _few(r.get("adapters") or []),
            r["reason"] or "-",
        )
    console.print(t if rows else "no replicas")


def _few(names: list[str], shown: int = 3) -> str:
    """A list a table cell can hold: the first `shown` names, then how many more."""
    more = f" +{len(names) - shown}" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more if names else "-"


def explain(d: dict[str, Any]) -> None:
    # with a role, profiles are numbered among those that may serve that pool
    name = f"{d['model']} ({d['role']} pool)" if d.get("role") else d["model"]
    if d["profile"] is None:
        console.print(f"[bold red]{name}: no node can take another replica[/bold red]")
    else:
        where = ", ".join(f"{n} (devices {list(devs) or 'cpu'})" for n, devs in d["nodes"])
        console.print(f"[bold]{name}[/bold]: profile {d['profile']} on {where}")
    t = Table("profile", "node", "", "reason")
    for c in d["candidates"]:
        t.add_row(str(c["profile"]), c["node"], "✓" if c["ok"] else "✗", c["reason"])
    console.print(t)
    if d.get("ranks"):
        r = Table("rank", "node", "runs", "rendezvous", "environment")
        for rank in d["ranks"]:
            env = " ".join(f"{k}={v}" for k, v in sorted(rank["env"].items()))
            r.add_row(str(rank["rank"]), rank["node"], rank["runs"], rank["rendezvous"], env)
        console.print(r)
    if d.get("adapters"):
        a = Table("adapter", "held by", "why")
        for row in d["adapters"]:
            pin = " (pinned)" if row["pin"] else ""
            a.add_row(row["adapter"] + pin, _few(row["held_by"]), row["why"])
        console.print(a)


def explain_scaling(d: dict[str, Any]) -> None:
    for pool in d["pools"]:
        name = f"{d['model']} ({pool['role']} pool)" if pool["role"] else d["model"]
        bounds = f"min {pool['min']}, max {pool['max']}"
        got = pool["decision"]
        if got is None:
            console.print(
                f"[bold]{name}[/bold] ({bounds}): no decision recorded yet "
                "(is a router leading the reconciler?)"
            )
            continue
        when = time.strftime("%H:%M:%S", time.localtime(got["at_unix"]))
        unit = got.get("unit", "requests")
        capacity = "not learned" if got["capacity"] is None else f"{got['capacity']:g} {unit}"
        console.print(
            f"[bold]{name}[/bold] ({bounds}): target {got['desired']}{_forged(got)}, "
            f"{got['current']} placed — {got['reason']}"
        )
        console.print(
            f"  demand {got['demand']:g} {unit}, capacity per replica {capacity}, decided {when}"
        )
        t = Table("at", "", "target", "reason")
        for h in reversed(got["history"]):
            at = time.strftime("%H:%M:%S", time.localtime(h["at_unix"]))
            target = f"{h['current']} → {h['desired']}{_forged(h)}"
            t.add_row(at, h["direction"], target, h["reason"])
        if got["history"]:
            console.print(t)
    p = d["policy"]
    slo = ", ".join(f"{k} {p[k]:g}" for k in ("ttft_p90_ms", "itl_p90_ms") if p[k] is not None)
    console.print(
        f"policy: {'on' if p['enabled'] else 'off'}; utilization {p['utilization']:.0%}, "
        f"hysteresis {p['hysteresis']:.0%}, up every {p['up_cooldown_s']:g} s (at most "
        f"{p['max_step_up']}), down after {p['down_cooldown_s']:g} s and a "
        f"{p['stabilization_s']:g} s window; SLO: {slo or 'none'}"
    )


def _forged(decision: dict[str, Any]) -> str:
    """A note for a target the record put outside the pool's bounds (cluster_ops clamps it)."""
    said = decision.get("recorded_desired")
    return "" if said is None else f" [red](the record says {said}: out of bounds)[/red]"


def status(s: dict[str, Any]) -> None:
    for p in s.get("local_processes", []):
        state = "[green]running[/green]" if p["alive"] else "[red]gone[/red]"
        console.print(f"{p['name']:7} pid {p['pid']:<7} {state}  log {p['log']}")
    console.print(f"reconciler leader: {s['leader'] or '[red]none (is a router running?)[/red]'}")
    nodes(s["nodes"])
    models(s["models"])
    for model, lines in s["unplaceable"].items():
        console.print(f"[yellow]{model} cannot be placed:[/yellow]")
        for line in lines:
            console.print(f"  {line}")
