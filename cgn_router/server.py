"""cgn-router's OpenAI surface: one request from the client to an engine and back.

    _handle    one Account (its records' observers); key → body → model → rate limit →
      │        prompt hashed (off the loop when big) → admission → one RequestContext;
      │        Ended, once, however it ends
      └ _serve  for each model of the fallback chain, up to `attempts` endpoints:
          │     legs.route (filters → scorers → picker over a registry snapshot)
          ├ legs.attempt  Attempt (Registry.begin … lease.end(outcome)) around
          │               Proxy.run(call, lease); P/D: legs.disaggregate first
          └ migration.migrate  a stream that broke mid-answer: continued on another
                               replica of the same model from the token ids sent

A request is parsed only as far as routing needs (model, stream, the prompt
for hashing, the session); its body goes upstream byte for byte unless the
router must change it (a fallback model, `include_usage` injected). Retries
go to another endpoint, and only before the first byte reached the client;
after it, only a continuation of the same answer by the same model (never a
fallback: that would splice two models' answers into one).

This module counts nothing: each step emits a record to the request's
`Account` (cgn_router/routing/lifecycle.py), whose observers are the metrics, the
autoscaler's load signals and the request's trace; `Ended` is emitted in one
place, `_handle`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time

from cgn_core.errors import (
    BadGateway,
    CognitoraError,
    MethodNotAllowed,
    NotFound,
    Unauthorized,
    Unavailable,
    UpstreamTimeout,
)
from cgn_core.h1 import Handler, Reply, Request, Server, StreamReply
from cgn_router.adapters import place
from cgn_router.admit import Admission, admission, budgeted, hash_prompt, own
from cgn_router.auth import visible
from cgn_router.context import RequestContext
from cgn_router.legs import PATHS, attempt, disaggregate, held, route
from cgn_router.load_signals import WINDOW_S
from cgn_router.migration import migrate
from cgn_router.proxy import AttemptFailed, Relayed
from cgn_router.routing.lifecycle import (
    Account,
    Ended,
    Fallback,
    Refused,
    Retried,
    Unrouted,
)
from cgn_router.service import RouterService
from cgn_router.types import EndpointId, RequestInfo

log = logging.getLogger(__name__)
# Bodies from this size on are templated, tokenized and hashed on a worker thread: ~64 KiB
# tokenizes in ~10 ms here, the longest a stream relay should wait for the loop.
OFF_LOOP_BYTES = 64 << 10


def build_front(svc: RouterService) -> Server:
    """The OpenAI surface as an HTTP/1.1 server (cgn_core/h1.py): not yet listening."""
    routes: dict[tuple[str, str], Handler] = {
        ("POST", path): functools.partial(_handle, svc, kind=kind) for kind, path in PATHS.items()
    }
    routes["GET", "/v1/models"] = functools.partial(_models, svc)
    paths = {path for _, path in routes}

    async def dispatch(request: Request) -> Reply | StreamReply:
        handler = routes.get((request.method, request.path))
        if handler is not None:
            return await handler(request)
        if request.path in paths:
            raise MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
        raise NotFound(f"no such path: {request.path}")

    return Server(
        dispatch,
        max_body_bytes=svc.settings.max_body_bytes,
        idle_timeout_s=svc.settings.http.idle_timeout_s,
    )


async def _handle(svc: RouterService, request: Request, *, kind: str) -> Reply | StreamReply:
    """Authenticate, validate, rate-limit, tokenize, admit, then route and proxy.

    NOTE: the order bounds what a request costs before it is refused: the key is checked
    before the body is read, and the rate limiter charges an estimate of the prompt (its
    bytes / 4) before anything is tokenized; the exact count corrects it afterwards."""
    acct = svc.account(kind, request.headers)
    status, usage, error = 500, None, ""
    try:
        relayed = await _handle_accounted(svc, request, kind, acct)
        status, usage, error = relayed.response.status, relayed.usage, relayed.cause or ""
        return relayed.response
    except CognitoraError as err:
        status, error = err.http_status, err.code or type(err).__name__
        raise
    except BaseException as exc:  # a bug (a 500), or the client left
        error = type(exc).__name__
        raise
    finally:
        seconds = time.monotonic() - acct.started
        who = (acct.tenant, acct.endpoint, acct.key_id, acct.adapter)
        acct.emit(Ended(acct.model, acct.outcome, status, seconds, usage, error, *who))


async def _handle_accounted(
    svc: RouterService, request: Request, kind: str, acct: Account
) -> Relayed:
    try:  # 401 before anything else is read
        who = svc.principal(request.headers.get("Authorization"))
    except Unauthorized:
        acct.emit(Refused("-", "unauthorized"))
        raise
    budgeted(svc, who, acct)
    raw = await request.read(svc.settings.http.body_timeout_s)
    async with admission(svc, kind, raw, who, acct) as adm:
        ctx = _context(svc, request, kind, adm, raw)
        if adm.adapter is not None:
            # NOTE: no fallback (another model has not this adapter); engines get the
            # tenant's salt and salt an adapter's blocks themselves, as `salt` did here
            ctx = dataclasses.replace(ctx, chain=(adm.model,), adapter=(adm.adapter, adm.scale))
        relayed = await _serve(svc, request, ctx, acct)
        adm.settle(relayed.usage)
        return relayed


def _context(
    svc: RouterService, request: Request, kind: str, adm: Admission, raw: bytes
) -> RequestContext:
    body, who = adm.body, adm.who
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    session = request.headers.get(svc.settings.routing.session_header) or body.get("user")
    entry = svc.catalog.entry(adm.model)
    rid = request.headers.get("x-request-id", "")
    return RequestContext(
        kind=kind,
        asked=body["model"],
        chain=(adm.model, *(entry.fallbacks if entry else ())),
        body=body,
        raw=raw,
        stream=adm.stream,
        strip_usage=adm.stream and not wants_usage,
        session=session if isinstance(session, str) else None,
        band=who.band,
        priority=svc.engine_priority(who.band),
        kv_salt=who.kv_salt,
        started=adm.started,
        deadline=adm.started + svc.settings.deadlines.total_s,
        prompt=adm.prompt,
        response_headers=(
            {"x-cgn-queue-ms": str(round(adm.waited * 1000))} if adm.waited > 0 else {}
        ),
        request_id="" if "\r" in rid or "\n" in rid else rid,
    )


async def _serve(
    svc: RouterService, request: Request, ctx: RequestContext, acct: Account
) -> Relayed:
    """Try the request's models in order, each on up to `attempts` endpoints."""
    await _cold_start(svc, ctx, acct)
    barred = frozenset[EndpointId]()  # endpoints this request may not go to
    if ctx.adapter is not None:  # a replica must hold its adapter (loaded here if need be)
        barred = await place(svc, ctx.model, ctx.adapter[0], ctx.deadline)
    last: AttemptFailed | None = None
    for served in ctx.chain:
        prompt = (
            ctx.prompt
            if served == ctx.model
            else hash_prompt(svc, ctx.kind, served, ctx.body, acct, ctx.kv_salt)
        )
        # a model with a prefill pool: the request goes to a decode (or both) replica, and
        # maybe (_disaggregate) its prompt to a prefill replica first
        pd = ctx.kind != "embeddings" and svc.registry.has_prefill_pool(served)
        role = "decode" if pd else "both"
        adapter = ctx.adapter[0] if ctx.adapter else None
        req = RequestInfo(served, role, prompt.blocks, prompt.tokens, ctx.session, adapter)
        payload = ctx.payload(served)
        tried: set[EndpointId] = set()
        for _ in range(max(1, svc.settings.attempts)):
            view = route(svc, req, frozenset(tried) | barred, acct)
            headers = dict[str, str]()
            if view is not None and not tried and served == ctx.model:
                view, headers = await held(svc, ctx, req, view, acct)
            if view is None:
                break
            if tried:
                acct.emit(Retried(ctx.model))
            tried.add(view.id)
            body = payload
            if pd:
                body, split = await disaggregate(svc, ctx, req, view, payload, acct)
                headers.update(split)
            try:
                movable = frozenset(tried) if len(tried) < svc.settings.attempts else None
                relayed = await attempt(
                    svc, request, ctx, req, view, body, headers, acct, tried=movable
                )
            except AttemptFailed as exc:
                log.info("attempt failed: %s", exc.message)
                last = exc
                continue
            if relayed.broken is not None:
                relayed = await migrate(svc, request, ctx, req, relayed, tried, acct)
            if served != ctx.model:
                acct.emit(Fallback(ctx.model, served))
            return relayed
    raise _no_answer(ctx.model, last, acct, ctx.adapter[0] if ctx.adapter else None)


COLD_POLL_S = 0.25


async def _cold_start(svc: RouterService, ctx: RequestContext, acct: Account) -> None:
    """A model that scales to zero (catalog `replicas.min: 0`) with no replica and no
    fallback that has one: the request is counted as demand for the autoscaler and held until
    a replica is routable, at most `cold_start_s` (and within the request's own deadline);
    then it is served, or a 503 with Retry-After. (A model at min 1 or more without a replica
    is a failure to route around, not a cold start: 503 at once, or its fallback.)"""
    model = ctx.model
    entry = svc.catalog.entry(model)
    if entry is None or not entry.scales_to_zero:
        return
    if any(svc.registry.serves(m) for m in ctx.chain):
        return
    hold = min(svc.settings.deadlines.cold_start_s, ctx.deadline - time.monotonic())
    if hold <= 0:
        return
    deadline, noted = time.monotonic() + hold, -math.inf
    log.info("no replica of %s yet: holding a request up to %.0f s", model, hold)
    while not svc.registry.serves(model):
        now = time.monotonic()
        if now >= deadline:
            acct.outcome = "no_endpoint"
            why = f"no replica of model '{model}' became ready within {hold:.0f} s"
            raise Unavailable(why, code="no_endpoint", retry_after_s=30)
        if now - noted >= WINDOW_S / 2:  # NOTE: the autoscaler counts the last minute's
            acct.emit(Unrouted(model))
            noted = now
        await asyncio.sleep(COLD_POLL_S)


def _no_answer(
    model: str, last: AttemptFailed | None, acct: Account, adapter: str | None = None
) -> CognitoraError:
    """The error for a request no endpoint answered: none to try, or every attempt failed."""
    if last is None:
        acct.emit(Unrouted(model))  # demand for a pool with no replica (min 0)
        acct.outcome = "no_endpoint"
        what = f"model '{model}'" + (f" with LoRA adapter '{adapter}' loaded" if adapter else "")
        return Unavailable(f"no ready endpoint serves {what}", code="no_endpoint")
    acct.outcome = "upstream_error"
    if last.timeout:
        return UpstreamTimeout(f"no engine answered in time: {last.message}", code=last.cause)
    return BadGateway(f"no engine could serve the request: {last.message}", code=last.cause)


async def _models(svc: RouterService, request: Request) -> Reply:
    try:  # listing models needs a key too, as on OpenAI's API
        who = svc.principal(request.headers.get("Authorization"))
    except Unauthorized:
        Account(svc.observers).emit(Refused("-", "unauthorized"))
        raise
    data = [
        {
            "id": name,
            "object": "model",
            "created": svc.created,
            "owned_by": "cognitora",
            "root": model,
        }
        for name, model in sorted(visible(who, svc.known_models()).items())
    ]
    adapters = svc.catalog.adapters()
    for a in sorted(visible(who, own(adapters))):  # as vLLM lists one: its base as parent
        base = adapters[a]
        data.append({"id": a, "object": "model", "created": svc.created,
                     "owned_by": "cognitora", "root": base, "parent": base})  # fmt: skip
    return Reply.json({"object": "list", "data": data})
