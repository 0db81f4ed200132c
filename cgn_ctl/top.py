"""`cgn-ctl top`: the fleet's load now, per node and per model, refreshed in the terminal.

The figures are cgn-metrics' fleet view (`GET /api/v1/fleet`, docs/cgn-metrics.md): its
replicas (running, waiting, KV usage, output tokens/s, and the speed the routers learned
of each: ms per uncached prompt token and per output token), nodes (state, watts, joules per
output token) and totals. The view is read back with `FleetView.from_json`, which does not
trust it (a row of the wrong shape is left out, a number that is not a finite one is "no
figure"); `frame` is pure and sums each node's and each model's replicas. A figure no
replica publishes is None, shown as "—", never 0. The view is read up to `MAX_VIEW_BYTES`,
and its text reaches the terminal only through `plain` (no escape sequence, no markup:
cgn_core/terminal.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cgn_core.errors import CognitoraError
from cgn_core.fleet_view import FleetView, ReplicaView
from cgn_core.terminal import plain
from cgn_ctl.options import read_capped

DASH = "—"
MAX_VIEW_BYTES = 16 << 20  # a fleet view larger than this is not read
R = TypeVar("R")  # a table's row
REPLICA_ROWS = 40  # the replicas table shows this many (the slowest decode first); --json all


class MetricsUnreachable(CognitoraError):
    """cgn-metrics did not answer, or answered with something that is not a fleet view."""


@dataclass(frozen=True, slots=True)
class Row:
    """One node or one model: its replicas' load summed (KV usage: the fullest replica)."""

    name: str
    state: str
    replicas: int
    ready: int
    running: float | None
    waiting: float | None
    tokens_per_s: float | None
    kv_usage: float | None
    watts: float | None  # nodes only
    j_per_output_token: float | None


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One replica: its load and the speed the routers learned of it (None: not learned)."""

    name: str
    model: str
    node: str
    state: str
    running: float | None
    waiting: float | None
    tokens_per_s: float | None
    prefill_ms_per_token: float | None
    decode_ms_per_token: float | None


@dataclass(frozen=True, slots=True)
class Frame:
    url: str
    at_unix: float
    requests_per_s: float | None
    tokens_per_s: float | None
    ttft_p95_s: float | None
    running: float | None
    waiting: float | None
    watts: float | None
    j_per_output_token: float | None
    energy_source: str
    nodes: tuple[Row, ...]
    models: tuple[Row, ...]
    replicas: tuple[ReplicaRow, ...]  # the slowest decode first; not learned last
    down: tuple[str, ...]  # "target: error" for every target that did not answer

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _total(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _fullest(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _row(name: str, state: str, reps: list[ReplicaView], **extra: float | None) -> Row:
    return Row(
        name=name,
        state=state,
        replicas=len(reps),
        ready=sum(1 for r in reps if r.state == "up"),
        running=_total(r.running for r in reps),
        waiting=_total(r.waiting for r in reps),
        tokens_per_s=_total(r.tokens_per_s for r in reps),
        kv_usage=_fullest(r.kv_usage for r in reps),
        watts=extra.get("watts"),
        j_per_output_token=extra.get("j_per_output_token"),
    )


def frame(view: FleetView, url: str) -> Frame:
    """One screen of `top` from a fleet view."""
    nodes = [
        _row(
            n.node,
            n.state or "?",
            [r for r in view.replicas if r.node == n.node],
            watts=n.watts,
            j_per_output_token=n.j_per_output_token,
        )
        for n in view.nodes
        if n.node
    ]
    models = []
    for m in view.models:
        if m.model:
            mine = [r for r in view.replicas if r.model == m.model]
            row = _row(m.model, "", mine, j_per_output_token=m.j_per_output_token)
            models.append(_with_placed(row, m.replicas))
    replicas = sorted(
        (_replica_row(r) for r in view.replicas),
        key=lambda r: (r.decode_ms_per_token is None, -(r.decode_ms_per_token or 0.0), r.name),
    )
    t = view.totals
    down = tuple(f"{x.id or '?'}: {x.error or 'down'}" for x in view.targets if x.state == "down")
    return Frame(
        url=url,
        at_unix=view.time if 0 < view.time < 1 << 34 else time.time(),  # a real time
        requests_per_s=t.requests_per_s,
        tokens_per_s=t.tokens_per_s,
        ttft_p95_s=t.ttft_s.get("p95"),
        running=t.running,
        waiting=t.waiting,
        watts=t.watts,
        j_per_output_token=t.j_per_output_token,
        energy_source=t.energy_source or "unavailable",
        nodes=tuple(nodes),
        models=tuple(models),
        replicas=tuple(replicas),
        down=down,
    )


def _replica_row(r: ReplicaView) -> ReplicaRow:
    name = r.replica or r.url or "?"
    return ReplicaRow(name, r.model, r.node, r.state, r.running, r.waiting, r.tokens_per_s,
                      r.prefill_ms_per_token, r.decode_ms_per_token)  # fmt: skip


def _with_placed(row: Row, placed: int) -> Row:
    """A model's replica count is what etcd places (a replica not yet scraped counts too)."""
    return Row(**{**asdict(row), "replicas": max(row.replicas, placed), "state": ""})


def fetch(url: str, timeout_s: float = 5.0) -> Frame:
    """The frame from cgn-metrics at `url` (its base URL); MetricsUnreachable says why not."""
    api = url.rstrip("/") + "/api/v1/fleet"
    try:
        with httpx.stream("GET", api, timeout=timeout_s) as resp:
            resp.raise_for_status()
            body = read_capped(resp, MAX_VIEW_BYTES)
            if body is None:
                raise MetricsUnreachable(f"{api} answered more than {MAX_VIEW_BYTES} bytes")
        view = json.loads(body)
    except (httpx.HTTPError, ValueError) as exc:
        raise MetricsUnreachable(
            f"cannot read the fleet from cgn-metrics at {url} ({type(exc).__name__}: {exc}); "
            "is it running? (`cgn-ctl up` starts one; --metrics URL names another)"
        ) from None
    if not isinstance(view, Mapping):
        raise MetricsUnreachable(f"{api} answered JSON that is not a fleet view")
    return frame(FleetView.from_json(view), url)


# ---- rendering -----------------------------------------------------------------------------


def _f(value: float | None, digits: int = 1, unit: str = "") -> str:
    return DASH if value is None else f"{value:,.{digits}f}{unit}"


def _pct(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.0f} %"


def _table(title: str, rows: Iterable[Row], *, per_node: bool) -> Table:
    """Nodes (with their state and watts) or models, one row each."""
    columns: list[tuple[str, Callable[[Row], str]]] = [
        ("node" if per_node else "model", lambda r: r.name),
        *([("state", lambda r: r.state)] if per_node else []),
        ("ready/replicas", lambda r: f"{r.ready}/{r.replicas}"),
        ("running", lambda r: _f(r.running, 0)),
        ("waiting", lambda r: _f(r.waiting, 0)),
        ("tokens/s", lambda r: _f(r.tokens_per_s)),
        ("KV use (max)", lambda r: _pct(r.kv_usage)),
        *([("watts", lambda r: _f(r.watts, 0))] if per_node else []),
        ("J/output token", lambda r: _f(r.j_per_output_token, 3)),
    ]
    return _as_table(title, columns, rows)


def _as_table(
    title: str, columns: Sequence[tuple[str, Callable[[R], str]]], rows: Iterable[R]
) -> Table:
    """`rows` as a table of `columns` (a heading and how a row's cell reads)."""
    table = Table(*(name for name, _ in columns), title=title, title_justify="left")
    for row in rows:
        table.add_row(*(Text(plain(cell(row))) for _, cell in columns))  # Text: no markup
    return table


def _replicas(rows: tuple[ReplicaRow, ...]) -> Table:
    """Each replica's load and learned speed, the slowest first (at most REPLICA_ROWS)."""
    columns: list[tuple[str, Callable[[ReplicaRow], str]]] = [
        ("replica", lambda r: r.name),
        ("model", lambda r: r.model),
        ("node", lambda r: r.node),
        ("state", lambda r: r.state),
        ("running", lambda r: _f(r.running, 0)),
        ("waiting", lambda r: _f(r.waiting, 0)),
        ("tokens/s", lambda r: _f(r.tokens_per_s)),
        ("prefill ms/token", lambda r: _f(r.prefill_ms_per_token, 3)),
        ("decode ms/token", lambda r: _f(r.decode_ms_per_token, 1)),
    ]
    more = len(rows) - REPLICA_ROWS
    title = "replicas" + (f" (the {REPLICA_ROWS} slowest of {len(rows)})" if more > 0 else "")
    return _as_table(title, columns, rows[:REPLICA_ROWS])


def render(f: Frame, error: str = "") -> Group:
    """The frame as rich renderables: a line of totals, the nodes, the models, what is down."""
    head = Text.assemble(
        ("cgn-ctl top", "bold"),
        f"  {plain(f.url)}  {time.strftime('%H:%M:%S', time.localtime(f.at_unix))}\n",
        f"requests/s {_f(f.requests_per_s)}   output tokens/s {_f(f.tokens_per_s)}   "
        f"TTFT p95 {_f(f.ttft_p95_s, 3, ' s')}   running {_f(f.running, 0)}   "
        f"waiting {_f(f.waiting, 0)}   watts {_f(f.watts, 0)}   "
        f"J/output token {_f(f.j_per_output_token, 3)} ({plain(f.energy_source)})",
    )
    nodes = _table("nodes", f.nodes, per_node=True)
    models = _table("models", f.models, per_node=False)
    parts: list[Any] = [head, nodes if f.nodes else Text("no nodes"), models]
    if f.replicas:
        parts.append(_replicas(f.replicas))
    if f.down:
        parts.append(Text("down: " + "; ".join(map(plain, f.down)), style="yellow"))
    if error:
        parts.append(Text(plain(error), style="red"))
    return Group(*parts)


def live(url: str, interval_s: float, console: Console) -> None:
    """Refresh the frame every `interval_s` until Ctrl-C; an unreachable cgn-metrics keeps the
    last frame on screen with the reason under it, and is tried again."""
    last: Frame | None = None
    with Live(console=console, auto_refresh=False, screen=False) as screen:
        try:
            while True:
                error = ""
                try:
                    last = fetch(url)
                except MetricsUnreachable as exc:
                    error = exc.message
                shown = last or frame(FleetView.from_json({}), url)
                screen.update(render(shown, error), refresh=True)
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return
