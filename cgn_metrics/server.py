"""cgn-metrics' HTTP side: the dashboard, its JSON API, federation, /metrics, /health.

| path | what |
|---|---|
| `GET /` | the dashboard (`dashboard.html`, one self-contained file) |
| `GET /api/v1/fleet` | the latest fleet view (cgn_metrics.fleet.summarize) |
| `GET /api/v1/history?prefix=fleet:&since=UNIX` | history series: `{name: [[t, v], ...]}` |
| `GET /api/v1/targets` | every target, its state and last error |
| `GET /federate` | every target's last kept samples, labelled with the target; the fleet |
| `GET /metrics` | the fleet series (`cgn_fleet_*`, `cgn_node_*`, `cgn_model_*`, targets up) |
| `GET /health` | 200, or 503 when the scrape loop has stalled |

The API answers any origin (`Access-Control-Allow-Origin: *`): the dashboard opened
from disk points at any cgn-metrics URL. It exposes only what /metrics pages already
do, read-only.
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

from aiohttp import web

from cgn_core.fleet_view import FleetView
from cgn_core.http import Runner, error_middleware
from cgn_core.readiness import bind_tcp
from cgn_metrics.monitor import Monitor
from cgn_metrics.settings import MetricsSettings

CORS = {"Access-Control-Allow-Origin": "*"}
TEXT = "text/plain; version=0.0.4; charset=utf-8"


def dashboard_html() -> str:
    return resources.files("cgn_metrics").joinpath("dashboard.html").read_text(encoding="utf-8")


def build_app(monitor: Monitor) -> web.Application:
    app = web.Application(middlewares=[error_middleware(1 << 16, lambda _: None)])
    page = dashboard_html()

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    async def fleet(_: web.Request) -> web.Response:
        view = monitor.view.to_json() if monitor.view is not None else {}
        return web.json_response(_finite({**view, "rounds": monitor.rounds}), headers=CORS)

    async def history(request: web.Request) -> web.Response:
        prefix = request.query.get("prefix", "fleet:")
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            since = 0.0
        out = {}
        for name, ring in sorted(monitor.history.items()):
            if name.startswith(prefix):
                t, v = ring.points(since)
                out[name] = [[round(float(a), 3), float(b)] for a, b in zip(t, v, strict=True)]
        return web.json_response(out, headers=CORS)

    async def targets(_: web.Request) -> web.Response:
        view = monitor.view.to_json() if monitor.view is not None else {}
        return web.json_response(_finite(view.get("targets", [])), headers=CORS)

    async def federate(_: web.Request) -> web.Response:
        return web.Response(text=federation_text(monitor), headers={"Content-Type": TEXT, **CORS})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=fleet_text(monitor.view), headers={"Content-Type": TEXT})

    async def health(_: web.Request) -> web.Response:
        ok, why = monitor.healthy()
        body = {"status": "ok" if ok else "failed", **({"reason": why} if why else {})}
        return web.json_response(body, status=200 if ok else 503)

    app.router.add_get("/", index)
    app.router.add_get("/api/v1/fleet", fleet)
    app.router.add_get("/api/v1/history", history)
    app.router.add_get("/api/v1/targets", targets)
    app.router.add_get("/federate", federate)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


async def start_http(settings: MetricsSettings, monitor: Monitor) -> tuple[Runner, int]:
    sock = bind_tcp(settings.http.host, settings.http.port)
    runner = Runner(
        build_app(monitor), idle_timeout_s=settings.http.idle_timeout_s, access_log=None
    )
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, int(sock.getsockname()[1])


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    """A label value as the text format writes it (backslash, quote, newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _line(name: str, labels: dict[str, str], value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return ""
    return f"{name}{_labels(labels)} {value:.17g}\n"


def fleet_text(view: FleetView | None) -> str:
    """The fleet series in Prometheus' text format (absent figures are absent, not 0)."""
    if view is None:
        return ""
    t, source = view.totals, {"source": view.totals.energy_source}
    families: list[tuple[str, list[tuple[dict[str, str], float | None]]]] = [
        ("cgn_fleet_requests_per_second", [({}, t.requests_per_s)]),
        ("cgn_fleet_tokens_per_second", [({}, t.tokens_per_s)]),
        ("cgn_fleet_requests_waiting", [({}, t.waiting)]),
        ("cgn_fleet_power_watts", [(source, t.watts)]),
        ("cgn_fleet_energy_per_output_token_joules", [(source, t.j_per_output_token)]),
        ("cgn_fleet_ttft_seconds", [({"quantile": q[1:]}, v) for q, v in t.ttft_s.items()]),
        ("cgn_fleet_itl_seconds", [({"quantile": q[1:]}, v) for q, v in t.itl_s.items()]),
    ]
    nodes = [({"node": n.node, "source": n.source}, n) for n in view.nodes]
    models = [({"model": m.model}, m) for m in view.models]
    families += [
        ("cgn_node_power_watts", [(lb, n.watts) for lb, n in nodes]),
        (
            "cgn_node_energy_per_output_token_joules",
            [(lb, n.j_per_output_token) for lb, n in nodes],
        ),
        ("cgn_node_energy_per_token_joules", [(lb, n.j_per_token) for lb, n in nodes]),
        ("cgn_node_state", [({"node": n.node, "state": n.state}, 1.0) for n in view.nodes]),
        ("cgn_model_tokens_per_second", [(lb, m.tokens_per_s) for lb, m in models]),
        (
            "cgn_model_energy_per_output_token_joules",
            [(lb, m.j_per_output_token) for lb, m in models],
        ),
        (
            "cgn_metrics_target_up",
            [
                ({"target": x.id, "kind": x.kind}, 1.0 if x.state == "up" else 0.0)
                for x in view.targets
            ],
        ),
    ]
    out = []
    for name, samples in families:
        out.append(f"# TYPE {name} gauge\n")
        out += [_line(name, labels, value) for labels, value in samples]
    return "".join(out)


def federation_text(monitor: Monitor) -> str:
    """Every target's last kept samples, with `cgn_target`, `cgn_kind`, `node`, `model`
    labels added (untyped, as Prometheus' own /federate), then the fleet series."""
    lines: list[str] = []
    for scraped in list(monitor.scraped.values()):
        t = scraped.target
        extra = {"cgn_target": t.id, "cgn_kind": t.kind}
        extra.update({k: v for k, v in (("node", t.node), ("model", t.model)) if v})
        for (name, labels), value in sorted(scraped.latest.items()):
            lines.append(_line(name, {**dict(labels), **extra}, value))
    return "".join(lines) + fleet_text(monitor.view)
