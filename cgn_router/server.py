"""cgn-router's HTTP edges: the OpenAI surface and the admin listener.

A request is parsed only as far as routing needs (model, stream, the prompt
for hashing, the session); its body goes upstream byte for byte unless the
router must change it (a fallback model, `include_usage` injected). Routing
is a pure decision over a snapshot (`pipeline.py`); this module acts on it:
attempts, retries on another endpoint before the first byte, fallbacks,
accounting.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cgn_core.blockhash import BLOCK_SIZE
from cgn_core.errors import (
    BadGateway,
    InvalidRequest,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
    UpstreamTimeout,
)
from cgn_core.http import Handler, error_middleware, mtls_middleware, parse_json, read_body
from cgn_core.openai_request import sampling_fields
from cgn_core.revocation import RevocationList
from cgn_router.auth import KeyStore, Limiter, Principal, authorize, authorize_admin
from cgn_router.catalog import Catalog
from cgn_router.control import ControlState
from cgn_router.gate import Gate
from cgn_router.metrics import RouterMetrics
from cgn_router.pipeline import Decision, Pipeline
from cgn_router.prompts import CHARS_PER_TOKEN, HashedPrompt
from cgn_router.proxy import Attempt, AttemptFailed, Proxy
from cgn_router.registry import Registry
from cgn_router.settings import RouterSettings
from cgn_router.types import EndpointId, EndpointView, RequestInfo

log = logging.getLogger(__name__)
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
# Bodies from this size on are templated, tokenized and hashed on a worker thread: ~64 KiB
# tokenizes in ~10 ms here, the longest a stream relay should wait for the loop.
OFF_LOOP_BYTES = 64 << 10


@dataclass(slots=True)
class RouterService:
    settings: RouterSettings
    catalog: Catalog
    registry: Registry
    pipeline: Pipeline
    proxy: Proxy
    metrics: RouterMetrics
    rng: random.Random = field(default_factory=random.Random)
    synced: bool = False  # the registry has loaded its sources once
    control: ControlState | None = None  # the reconciler, where this router runs one
    keys: KeyStore = field(default_factory=KeyStore)
    limiter: Limiter = field(default_factory=Limiter)
    gate: Gate | None = None  # admission; None when switched off
    revoked: RevocationList = field(default_factory=RevocationList)  # certificates refused

    def principal(self, request: web.Request) -> Principal:
        """Who is asking: the API key's principal, or the anonymous one while auth is off."""
        auth = self.settings.auth
        if not auth.enabled:
            return Principal("", auth.anonymous_tenant, auth.anonymous_band)
        try:
            return self.keys.authenticate(request.headers.get("Authorization"))
        except Unauthorized:
            self.metrics.admission_rejections.labels("-", "unauthorized").inc()
            raise

    created: int = field(default_factory=lambda: int(time.time()))

    def known_models(self) -> dict[str, str]:
        """Every name a client may use → the model it means (catalog and registry)."""
        names = dict(self.catalog.names())
        for model in self.registry.models():
            names.setdefault(model, model)
        return names

    def model_for(self, name: str) -> str | None:
        """The model `name` means, or None when neither catalog nor registry knows it."""
        model = self.catalog.names().get(name)
        if model is None and self.registry.serves(name):
            model = name
        return model

    def engine_priority(self, band: str) -> int | None:
        """The priority engines should give a request of `band` (None: send none)."""
        adm = self.settings.admission
        spec = adm.bands.get(band)
        return spec.priority if adm.engine_priority and spec is not None else None

    def route(self, req: RequestInfo, tried: frozenset[EndpointId]) -> Decision:
        views = self.registry.views(req, time.monotonic(), tried)
        decision = self.pipeline.route(req, views, self.rng)
        for name, n in decision.dropped.items():
            self.metrics.filter_drops.labels(name).inc(n)
        if decision.chosen is not None:
            for scorer, values in decision.scores.items():
                self.metrics.scores.labels(scorer).observe(values[decision.chosen])
            if decision.saturated:
                self.metrics.saturated.labels(req.model).inc(decision.saturated)
        return decision


def build_app(svc: RouterService) -> web.Application:
    errors = error_middleware(svc.settings.max_body_bytes)
    app = web.Application(client_max_size=svc.settings.max_body_bytes, middlewares=[errors])
    for kind, path in PATHS.items():
        app.router.add_post(path, functools.partial(_handle, svc, kind=kind))
    app.router.add_get("/v1/models", lambda r: _models(svc, r))
    return app


OPEN_ADMIN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})  # no client certificate needed


def build_admin_app(svc: RouterService) -> web.Application:
    """/metrics, /healthz and /readyz answer anyone; the management paths need a client
    certificate when the listener is HTTPS, else an admin-scoped API key while auth is on."""
    middlewares = [error_middleware(1 << 20)]
    if svc.settings.admin_tls.enabled:
        middlewares.append(mtls_middleware(OPEN_ADMIN_PATHS, svc.revoked))
    elif svc.settings.auth.enabled:
        middlewares.append(_admin_key_middleware(svc))
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/metrics", lambda r: _metrics(svc))
    app.router.add_get("/healthz", lambda r: _healthz())
    app.router.add_get("/readyz", lambda r: _readyz(svc))
    app.router.add_get("/endpoints", lambda r: _endpoints(svc))
    app.router.add_get("/reconciler", lambda r: _reconciler(svc))
    return app


def _admin_key_middleware(svc: RouterService) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_ADMIN_PATHS:
            authorize_admin(svc.principal(request))  # 401 without a key, 403 without the scope
        return await handler(request)

    return check


async def _reconciler(svc: RouterService) -> web.Response:
    """The control loop's state: leading or not, recent actions, models that cannot be placed."""
    if svc.control is None:
        return web.json_response({"enabled": False})
    return web.json_response({"enabled": True, **svc.control.to_json()})


async def _handle(svc: RouterService, request: web.Request, *, kind: str) -> web.StreamResponse:
    """Authenticate, validate, rate-limit, tokenize, admit, then route and proxy.

    NOTE: the order bounds what a request costs before it is refused: the key is checked
    before the body is read, and the rate limiter charges an estimate of the prompt (its
    bytes / 4) before anything is tokenized; the exact count corrects it afterwards."""
    started = time.monotonic()
    who = svc.principal(request)  # 401 before anything else is read
    raw = await read_body(request, svc.settings.http.body_timeout_s)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise InvalidRequest("'model' is required", param="model")
    # What cgn-infer would refuse for its generation fields is refused here, before any work.
    stream = kind != "embeddings" and sampling_fields(kind, body).stream
    model = svc.model_for(asked)
    if model is None:
        known = ", ".join(sorted(svc.known_models())) or "none"
        raise NotFound(
            f"model '{asked}' does not exist (known: {known})",
            code="model_not_found",
            param="model",
        )
    authorize(who, model)
    estimate = len(raw) // CHARS_PER_TOKEN
    try:
        svc.limiter.acquire(who, estimate)
    except RateLimited:
        svc.metrics.admission_rejections.labels(who.band, "rate_limited").inc()
        raise
    completion = 0
    try:
        first = await _hash_off_loop(svc, kind, model, body, len(raw))
        if first.tokens:
            svc.limiter.charge(who, first.tokens - estimate)
        waited = await svc.gate.enter(who.band, who.tenant, model) if svc.gate else 0.0
        try:
            resp, completion = await _route_and_proxy(
                svc, request, kind, body, raw, model, asked, stream, started, waited, first, who
            )
            return resp
        finally:
            if svc.gate:
                svc.gate.leave(model)
    finally:
        svc.limiter.release(who, completion)


async def _route_and_proxy(
    svc: RouterService,
    request: web.Request,
    kind: str,
    body: dict[str, Any],
    raw: bytes,
    model: str,
    asked: str,
    stream: bool,
    started: float,
    waited: float,
    first: HashedPrompt,
    who: Principal,
) -> tuple[web.StreamResponse, int]:
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    strip_usage = stream and kind != "embeddings" and not wants_usage
    session = request.headers.get(svc.settings.routing.session_header) or body.get("user")
    entry = svc.catalog.entry(model)
    chain = [model, *(entry.fallbacks if entry else ())]
    extra = {"x-cgn-queue-ms": str(round(waited * 1000))} if waited > 0 else {}
    priority = svc.engine_priority(who.band)
    last: AttemptFailed | None = None
    for served in chain:
        hashed = first if served == model else _hash(svc, kind, served, body)
        req = RequestInfo(
            served,
            "both",
            hashed.blocks,
            hashed.tokens,
            session if isinstance(session, str) else None,
        )
        payload = _payload(raw, body, served, asked, strip_usage)
        tried: set[EndpointId] = set()
        for _ in range(max(1, svc.settings.attempts)):
            chosen = svc.route(req, frozenset(tried)).view
            if chosen is None:
                break
            if tried:
                svc.metrics.retries.labels(model).inc()
            tried.add(chosen.id)
            try:
                resp, completion = await _attempt(
                    svc, request, kind, req, chosen, payload, stream, strip_usage, started, extra,
                    priority,
                )  # fmt: skip
            except AttemptFailed as exc:
                log.info("attempt failed: %s", exc.message)
                svc.metrics.errors.labels(exc.cause).inc()
                last = exc
                continue
            if served != model:
                svc.metrics.fallbacks.labels(model, served).inc()
            return resp, completion
    if last is None:
        svc.metrics.requests.labels(model, "no_endpoint").inc()
        svc.metrics.errors.labels("no_endpoint").inc()
        raise Unavailable(f"no ready endpoint serves model '{model}'", code="no_endpoint")
    svc.metrics.requests.labels(model, "upstream_error").inc()
    if last.timeout:
        raise UpstreamTimeout(f"no engine answered in time: {last.message}", code=last.cause)
    raise BadGateway(f"no engine could serve the request: {last.message}", code=last.cause)


async def _hash_off_loop(
    svc: RouterService, kind: str, model: str, body: dict[str, Any], size: int
) -> HashedPrompt:
    """`_hash`, on a worker thread when the body is big enough to stall other streams."""
    if size < OFF_LOOP_BYTES:
        return _hash(svc, kind, model, body)
    return await asyncio.to_thread(_hash, svc, kind, model, body)


def _hash(svc: RouterService, kind: str, model: str, body: dict[str, Any]) -> HashedPrompt:
    if kind == "embeddings":
        return HashedPrompt((), 0, "none")
    hashed = svc.catalog.hasher(model).hash(kind, body)
    svc.metrics.hashed.labels(model, hashed.method).inc()
    return hashed


def _payload(raw: bytes, body: dict[str, Any], served: str, asked: str, strip_usage: bool) -> bytes:
    """The upstream body: the client's bytes unless the model or stream options must change."""
    if served == asked and not strip_usage:
        return raw
    changed = dict(body, model=served)
    if strip_usage:
        options = body.get("stream_options")
        changed["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    return json.dumps(changed, ensure_ascii=False).encode()


async def _attempt(
    svc: RouterService,
    request: web.Request,
    kind: str,
    req: RequestInfo,
    chosen: EndpointView,
    payload: bytes,
    stream: bool,
    strip_usage: bool,
    started: float,
    extra_headers: dict[str, str],
    priority: int | None,
) -> tuple[web.StreamResponse, int]:
    """One attempt; returns the response and the completion tokens the engine reported."""
    eid = chosen.id
    state = svc.registry.states[eid]
    now = time.monotonic()
    predicted = min(chosen.matched_blocks * BLOCK_SIZE, req.prompt_tokens)
    a = Attempt(
        state, PATHS[kind], payload, stream, strip_usage, req.model, req.prompt_tokens - predicted
    )
    a.extra_headers = extra_headers
    a.priority = priority
    state.breaker.on_attempt(now)
    state.in_flight += 1
    state.pending_prefill += a.uncached_tokens
    svc.registry.index.routed(eid, req.blocks, now, exact=bool(state.endpoint.kv_events_url))
    svc.registry.sessions.record(req.session, eid, now)
    pending = True

    def first_byte() -> None:
        nonlocal pending
        if pending:
            state.pending_prefill -= a.uncached_tokens
            pending = False
        state.breaker.on_success()
        svc.metrics.ttft.labels(req.model).observe(time.monotonic() - started)

    outcome = "client_disconnected"  # until known otherwise: aiohttp cancels us when it leaves
    try:
        resp = await svc.proxy.run(request, a, started, first_byte)
        outcome = "ok" if resp.status == 200 else "client_error"
        if a.client_gone:
            outcome = "client_disconnected"
        elif a.failed_mid_stream:
            outcome = "upstream_error"
            svc.metrics.errors.labels(a.failed_mid_stream).inc()
            state.breaker.on_failure(time.monotonic())
        return resp, a.usage.completion_tokens if a.usage else 0
    except AttemptFailed as exc:
        outcome = ""
        if exc.breaker:
            state.breaker.on_failure(time.monotonic())
        raise
    except (ConnectionError, OSError):  # the client went away mid-relay
        outcome = "client_disconnected"
        raise
    finally:
        state.in_flight -= 1
        if pending:
            state.pending_prefill -= a.uncached_tokens
        if outcome:
            svc.metrics.requests.labels(req.model, outcome).inc()
            svc.metrics.latency.labels(req.model).observe(time.monotonic() - started)
        if a.usage is not None:
            m, u = svc.metrics, a.usage
            m.tokens.labels(req.model, "prompt").inc(u.prompt_tokens)
            m.tokens.labels(req.model, "completion").inc(u.completion_tokens)
            m.prompt_tokens_routed.labels(req.model).inc(u.prompt_tokens)
            m.prefix_predicted.labels(req.model).inc(predicted)
            m.prefix_reported.labels(req.model).inc(u.cached_tokens)


async def _models(svc: RouterService, request: web.Request) -> web.Response:
    svc.principal(request)  # listing models needs a key too, as on OpenAI's API
    data = [
        {
            "id": name,
            "object": "model",
            "created": svc.created,
            "owned_by": "cognitora",
            "root": model,
        }
        for name, model in sorted(svc.known_models().items())
    ]
    return web.json_response({"object": "list", "data": data})


async def _metrics(svc: RouterService) -> web.Response:
    return web.Response(
        body=generate_latest(svc.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _healthz() -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(svc: RouterService) -> web.Response:
    n = len(svc.registry.states)
    ready = svc.synced and n > 0
    auth = "enabled" if svc.settings.auth.enabled else "disabled (development only)"
    body = {"status": "ready" if ready else "not ready", "synced": svc.synced, "endpoints": n,
            "auth": auth, "admission": svc.gate is not None}  # fmt: skip
    return web.json_response(body, status=200 if ready else 503)


async def _endpoints(svc: RouterService) -> web.Response:
    """The registry as JSON (for `cgn-ctl` and for people)."""
    now = time.monotonic()
    reg = svc.registry
    out = []
    for eid, s in sorted(reg.states.items()):
        ep, load = s.endpoint, s.load
        out.append({
            "id": eid, "model": ep.model, "url": ep.url, "engine": ep.engine, "role": ep.role,
            "node": ep.node, "source": s.source, "cordoned": ep.node in reg.cordoned,
            "kv_tracking": "exact" if ep.kv_events_url else "approximate",
            "in_flight": s.in_flight, "pending_prefill_tokens": s.pending_prefill,
            "breaker": s.breaker.state(now), "scrape_error": s.scrape_error,
            "load": None if load is None else {
                "running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
                "age_s": round(now - load.scraped_at, 3),
            },
            "kv_blocks": {
                "exact": reg.index.exact_size(eid), "assumed": reg.index.assumed_size(eid),
            },
        })  # fmt: skip
    return web.json_response({"weights": svc.pipeline.weights, "endpoints": out})
