"""cgn-router's admin listener: /metrics, /healthz, /readyz, /endpoints, /reconciler, and
POST /debug/route (where a request would go now, and why: explain.py).

/metrics, /healthz and /readyz answer anyone; the management paths need a
client certificate when the listener is HTTPS, else an admin-scoped API key
while auth is on. With several workers (workers.py) the primary serves it: its
/metrics adds up every worker's page and its /healthz says when a worker is
down; the others serve only their own /metrics, on loopback, for the primary.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cgn_core.http import Handler, error_middleware, mtls_middleware, parse_json
from cgn_router.auth import authorize_admin
from cgn_router.explain import explain
from cgn_router.service import RouterService
from cgn_router.types import Speed
from cgn_router.workers.metrics_merge import merge_pages
from cgn_router.workers.supervisor import WorkerRole, sibling_admin_urls, workers_status

OPEN_ADMIN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})  # no client certificate needed


def build_admin_app(svc: RouterService, worker: WorkerRole | None = None) -> web.Application:
    if worker is not None and not worker.primary:
        own = web.Application(middlewares=[error_middleware(1 << 20)])
        own.router.add_get("/metrics", lambda r: _metrics(svc))
        return own
    middlewares = [error_middleware(1 << 20)]
    if svc.settings.admin_tls.enabled:
        middlewares.append(mtls_middleware(OPEN_ADMIN_PATHS, svc.revoked))
    elif svc.settings.auth.enabled:
        middlewares.append(_admin_key_middleware(svc))
    app = web.Application(middlewares=middlewares)
    if worker is None:
        app.router.add_get("/metrics", lambda r: _metrics(svc))
        app.router.add_get("/healthz", lambda r: _healthz())
    else:
        app.router.add_get("/metrics", lambda r: _all_metrics(svc, worker))
        app.router.add_get("/healthz", lambda r: _workers_healthz(worker))
    app.router.add_get("/readyz", lambda r: _readyz(svc))
    app.router.add_get("/endpoints", lambda r: _endpoints(svc))
    app.router.add_get("/reconciler", lambda r: _reconciler(svc))
    app.router.add_post("/debug/route", lambda r: _explain_route(svc, r))
    return app


async def _explain_route(svc: RouterService, request: web.Request) -> web.Response:
    """Where a request would go now and why (explain.py); the body is JSON, at most 1 MiB."""
    return web.json_response(explain(svc, parse_json(await request.read())))


def _admin_key_middleware(svc: RouterService) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_ADMIN_PATHS:
            authorize_admin(
                svc.principal(request.headers.get("Authorization"))
            )  # 401 without a key, 403 without the scope
        return await handler(request)

    return check


async def _reconciler(svc: RouterService) -> web.Response:
    """The control loop's state: leading or not, recent actions, models that cannot be placed."""
    if svc.control is None:
        return web.json_response({"enabled": False})
    return web.json_response({"enabled": True, **svc.control.to_json()})


async def _metrics(svc: RouterService) -> web.Response:
    return web.Response(
        body=generate_latest(svc.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _healthz() -> web.Response:
    return web.json_response({"status": "ok"})


SIBLING_TIMEOUT_S = 2.0


async def _all_metrics(svc: RouterService, worker: WorkerRole) -> web.Response:
    """Every worker's page added up (metrics_merge.py); a worker that does not answer is
    left out (and its absence shows on /healthz)."""
    timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
    urls = await asyncio.to_thread(sibling_admin_urls, worker)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def page(url: str) -> str | None:
            try:
                async with session.get(url + "/metrics") as resp:
                    return await resp.text() if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                return None

        others = await asyncio.gather(*(page(u) for u in urls))
    own = generate_latest(svc.metrics.registry).decode()
    body = merge_pages([own, *(p for p in others if p is not None)])
    return web.Response(text=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _workers_healthz(worker: WorkerRole) -> web.Response:
    """ok while every worker runs; 503 naming the ones down (being restarted)."""
    status = await asyncio.to_thread(workers_status, worker)
    down = [w for w in status["workers"] if not w.get("running")]
    body = {"status": "degraded" if down else "ok", **status}
    return web.json_response(body, status=503 if down else 200)


async def _readyz(svc: RouterService) -> web.Response:
    n = len(svc.registry.states)
    ready = svc.in_sync.is_set() and n > 0
    auth = "enabled" if svc.settings.auth.enabled else "disabled (development only)"
    body = {
        "status": "ready" if ready else "not ready",
        "synced": svc.in_sync.is_set(),
        "endpoints": n,
        "auth": auth,
        "admission": svc.gate is not None,
    }
    return web.json_response(body, status=200 if ready else 503)


def _speed(speed: Speed) -> dict[str, Any]:
    """An endpoint's learned speed (cgn_router/routing/speed.py), in milliseconds."""
    return {
        "warm": speed.warm,  # learned from its answers; else its model's typical or the prior
        "samples": round(speed.samples, 1),
        "overhead_ms": round(speed.overhead_s * 1e3, 3),
        "prefill_ms_per_token": round(speed.prefill_s * 1e3, 5),
        "first_token_ms_per_other_request": round(speed.ttft_per_other_s * 1e3, 3),
        "decode_ms_per_token": round(speed.decode_s * 1e3, 3),
        "decode_ms_per_token_per_batch": round(speed.per_batch_s * 1e3, 4),
    }


async def _endpoints(svc: RouterService) -> web.Response:
    """The registry as JSON (for `cgn-ctl` and for people)."""
    now = time.monotonic()
    reg = svc.registry
    out = []
    for eid, s in sorted(reg.states.items()):
        ep, load = s.endpoint, s.load
        out.append(
            {
                "id": eid,
                "model": ep.model,
                "url": ep.url,
                "engine": ep.engine,
                "role": ep.role,
                "node": ep.node,
                "source": s.source,
                "cordoned": ep.node in reg.cordoned,
                "kv_tracking": "exact" if ep.kv_events_url else "approximate",
                "in_flight": s.in_flight,
                "pending_prefill_tokens": s.pending_prefill,
                "breaker": s.breaker.state(now),
                "scrape_error": s.scrape_error,
                "load": None
                if load is None
                else {
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "age_s": round(now - load.scraped_at, 3),
                },
                "kv_blocks": {
                    "exact": reg.index.exact_size(eid),
                    "assumed": reg.index.assumed_size(eid),
                },
                "speed": _speed(speed := reg.speed(s, now)),
                # the drain clock and the lag (registry.py): what the time scorer adds
                "queued_tokens": round(s.queued_tokens(now, speed, lag := s.lag(now, speed))),
                "lag": round(lag, 2),
                # LoRA adapters it holds (at start and at run time) and at most (#60)
                "adapters": sorted(set(ep.adapters) | s.adapters),
                "adapter_slots": s.adapter_slots,
            }
        )
    return web.json_response({"weights": svc.chain.weights, "endpoints": out})
