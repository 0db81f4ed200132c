"""cgn-router's OpenAI surface: one request from the client to an engine and back.

    _handle    key → body → model → rate limit → prompt hashed (off the loop when
      │        big) → admission → one frozen RequestContext
      └ _serve  for each model of the fallback chain, up to `attempts` endpoints:
          │     route (filters → scorers → picker over a registry snapshot)
          ├ _attempt  Attempt (Registry.begin … lease.end(outcome)) around Proxy.run(call, lease)
          └ _migrate  a stream that broke mid-answer: continued on another replica of the
                      same model from the token ids sent (up to `migration.limit` times)

A request is parsed only as far as routing needs (model, stream, the prompt
for hashing, the session); its body goes upstream byte for byte unless the
router must change it (a fallback model, `include_usage` injected). Retries
go to another endpoint, and only before the first byte reached the client;
after it, only a continuation of the same answer by the same model (never a
fallback: that would splice two models' answers into one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from cgn_core.errors import (
    BadGateway,
    CognitoraError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RateLimited,
    Unavailable,
    UpstreamTimeout,
)
from cgn_core.h1 import Handler, Reply, Request, Server, StreamReply
from cgn_core.http import parse_json
from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.kv.transfer import FIELD as TRANSFER_FIELD
from cgn_core.kv.transfer import HEADER as TRANSFER_HEADER
from cgn_core.kv.transfer import fallback_reason, parse_transfer_params
from cgn_core.openai.request import sampling_fields
from cgn_core.openai.resume import FIELD as RESUME_FIELD
from cgn_router.attempt import Attempt
from cgn_router.auth import Principal, may_use, visible
from cgn_router.context import RequestContext
from cgn_router.disagg import decide
from cgn_router.load_signals import WINDOW_S
from cgn_router.prompts import CHARS_PER_TOKEN, HashedPrompt
from cgn_router.proxy import AttemptFailed, Call, Progress, Relayed
from cgn_router.service import RouterService
from cgn_router.trace import RequestTrace, end_upstream
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
PD_HEADER = "x-cognitora-pd"  # disaggregated (prefill <endpoint>), or aggregated: why


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
    trace = RequestTrace.start(svc.tracer, kind, request.headers)
    try:
        relayed = await _handle_traced(svc, request, kind, trace)
    except CognitoraError as err:
        trace.finish(err.http_status, error=err.code or type(err).__name__)
        raise
    except BaseException as exc:  # a bug (a 500), or the client left
        trace.finish(500, error=type(exc).__name__)
        raise
    usage = relayed.usage
    tokens = (usage.prompt_tokens, usage.completion_tokens) if usage else None
    trace.finish(relayed.response.status, usage=tokens, error=relayed.cause or "")
    return relayed.response


async def _handle_traced(
    svc: RouterService, request: Request, kind: str, trace: RequestTrace
) -> Relayed:
    started = time.monotonic()
    who = svc.principal(request.headers.get("Authorization"))  # 401 before anything else is read
    raw = await request.read(svc.settings.http.body_timeout_s)
    body, model, stream = _parse(svc, kind, raw, who, trace)
    estimate = len(raw) // CHARS_PER_TOKEN
    try:
        svc.limiter.acquire(who, estimate)
    except RateLimited:
        svc.metrics.admission_rejections.labels(who.band, "rate_limited").inc()
        raise
    completion = 0
    try:
        prompt = await _hash_off_loop(svc, kind, model, body, len(raw))
        if prompt.tokens:
            try:
                svc.limiter.settle(who, estimate, prompt.tokens)
            except RateLimited:
                svc.metrics.admission_rejections.labels(who.band, "rate_limited").inc()
                raise
        waited = await svc.gate.enter(who.band, who.tenant, model) if svc.gate else 0.0
        trace.admitted(waited)
        try:
            admitted = (who, started, waited)
            ctx = _context(svc, request, kind, body, raw, model, stream, prompt, admitted, trace)
            relayed = await _serve(svc, request, ctx)
        finally:
            if svc.gate:
                svc.gate.leave(model)
        completion = relayed.usage.completion_tokens if relayed.usage else 0
        return relayed
    finally:
        svc.limiter.release(who, completion)


def _parse(
    svc: RouterService, kind: str, raw: bytes, who: Principal, trace: RequestTrace
) -> tuple[dict[str, Any], str, bool]:
    """(body, the model it means, stream?) of a request body; 400 or 404 when it is wrong.
    A model outside `who`'s scope is a 404 worded as for one that does not exist, and the
    404 names only the models `who` may use: a key learns nothing of the others."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise InvalidRequest("'model' is required", param="model")
    trace.asked(asked, who.tenant, who.band, who.key_id)
    for field in (TRANSFER_FIELD, RESUME_FIELD):  # an engine dials what the first names, and
        if field in body:  # the second passes someone else's tokens off as the model's
            raise InvalidRequest(f"'{field}' is set by the router only", param=field)
    # What cgn-infer would refuse for its generation fields is refused here, before any work.
    stream = kind != "embeddings" and sampling_fields(kind, body).stream
    model = svc.model_for(asked)
    if model is None or not may_use(who, model):
        known = ", ".join(sorted(visible(who, svc.known_models()))) or "none"
        scoped = "" if who.record is None else " or this key may not use it"
        raise NotFound(
            f"model '{asked}' does not exist{scoped} (known: {known})",
            code="model_not_found",
            param="model",
        )
    return body, model, stream


def _context(
    svc: RouterService,
    request: Request,
    kind: str,
    body: dict[str, Any],
    raw: bytes,
    model: str,
    stream: bool,
    prompt: HashedPrompt,
    admitted: tuple[Principal, float, float],  # who, when the request came, how long it queued
    trace: RequestTrace = RequestTrace.OFF,
) -> RequestContext:
    who, started, waited = admitted
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    session = request.headers.get(svc.settings.routing.session_header) or body.get("user")
    entry = svc.catalog.entry(model)
    rid = request.headers.get("x-request-id", "")
    return RequestContext(
        kind=kind,
        asked=body["model"],
        chain=(model, *(entry.fallbacks if entry else ())),
        body=body,
        raw=raw,
        stream=stream,
        strip_usage=stream and not wants_usage,
        session=session if isinstance(session, str) else None,
        band=who.band,
        priority=svc.engine_priority(who.band),
        started=started,
        deadline=started + svc.settings.deadlines.total_s,
        prompt=prompt,
        response_headers={"x-cgn-queue-ms": str(round(waited * 1000))} if waited > 0 else {},
        request_id="" if "\r" in rid or "\n" in rid else rid,
        trace=trace,
    )


async def _serve(svc: RouterService, request: Request, ctx: RequestContext) -> Relayed:
    """Try the request's models in order, each on up to `attempts` endpoints."""
    await _cold_start(svc, ctx)
    last: AttemptFailed | None = None
    for served in ctx.chain:
        prompt = ctx.prompt if served == ctx.model else _hash(svc, ctx.kind, served, ctx.body)
        # a model with a prefill pool: the request goes to a decode (or both) replica, and
        # maybe (_disaggregate) its prompt to a prefill replica first
        pd = ctx.kind != "embeddings" and svc.registry.has_prefill_pool(served)
        role = "decode" if pd else "both"
        req = RequestInfo(served, role, prompt.blocks, prompt.tokens, ctx.session)
        payload = ctx.payload(served)
        tried: set[EndpointId] = set()
        for _ in range(max(1, svc.settings.attempts)):
            view = _route(svc, ctx, req, frozenset(tried))
            if view is None:
                break
            if tried:
                svc.metrics.retries.labels(ctx.model).inc()
            tried.add(view.id)
            body, headers = payload, dict[str, str]()
            if pd:
                body, headers = await _disaggregate(svc, ctx, req, view, payload)
            try:
                relayed = await _attempt(svc, request, ctx, req, view, body, headers)
            except AttemptFailed as exc:
                log.info("attempt failed: %s", exc.message)
                svc.metrics.errors.labels(exc.cause).inc()
                last = exc
                continue
            if relayed.broken is not None:
                relayed = await _migrate(svc, request, ctx, req, relayed, tried)
            if served != ctx.model:
                svc.metrics.fallbacks.labels(ctx.model, served).inc()
            return relayed
    raise _no_answer(svc, ctx.model, last)


def _route(
    svc: RouterService, ctx: RequestContext, req: RequestInfo, tried: frozenset[EndpointId]
) -> EndpointView | None:
    """The endpoint the chain picks (None: no candidate left), traced."""
    started = ctx.trace.clock()
    decision = svc.route(req, tried)
    ctx.trace.routed(decision, req.role, svc.chain.weights, started)
    return decision.view


async def _migrate(
    svc: RouterService,
    request: Request,
    ctx: RequestContext,
    req: RequestInfo,
    relayed: Relayed,
    tried: set[EndpointId],
) -> Relayed:
    """Continue a broken stream on other replicas of its model (those whose engine can
    resume), each continuation from the token ids the client has the text of, at most the
    model's migration limit in all; or end it, saying why not."""
    limit = svc.migration_limit(req.model)
    tries = 0
    while (broken := relayed.broken) is not None:
        try:
            resume = broken.resume_field()
            generated = len(resume["token_ids"])
            why = _no_migration(svc, ctx, req.prompt_tokens + generated, tries, limit)
        except ValueError as exc:
            resume, generated = {}, 0
            why = f"the stream cannot be continued from what it sent ({exc})"
        others = frozenset(tried | svc.cannot_resume(req.model))
        view = None if why else _route(svc, ctx, req, others)
        if not why and view is None:
            why = f"no other replica of {req.model} can continue it"
        if why or view is None:
            svc.metrics.migrations.labels(req.model, relayed.cause, "not_continued").inc()
            log.warning("a stream of %s broke (%s), not continued: %s", req.model, broken.why, why)
            ended = await svc.proxy.end(relayed, why)
            svc.metrics.request_ended(req.model, "upstream_error", ctx.started)
            return ended
        tries += 1
        tried.add(view.id)
        log.info(
            "continuing a stream of %s on %s from %d tokens (%s)",
            req.model,
            view.id,
            generated,
            broken.why,
        )
        payload = ctx.resume_payload(req.model, resume)
        try:
            after = await _attempt(svc, request, ctx, req, view, payload, {}, broken)
        except AttemptFailed as exc:  # the continuation did not start: another may
            log.info("continuation failed: %s", exc.message)
            svc.metrics.errors.labels(exc.cause).inc()
            svc.metrics.migrations.labels(req.model, relayed.cause, "failed").inc()
            continue
        svc.metrics.migrations.labels(req.model, relayed.cause, "continued").inc()
        relayed = after
    return relayed


def _no_migration(
    svc: RouterService, ctx: RequestContext, tokens: int, tries: int, limit: int
) -> str:
    """Why a broken stream of `tokens` (prompt and output) is not continued; "" when it is."""
    if tries >= limit:
        return f"migration limit {limit} reached" if limit else "migration is off"
    if time.monotonic() >= ctx.deadline:
        return "the request's deadline passed"
    if tokens > svc.settings.migration.max_tokens:
        return f"over migration.max_tokens ({svc.settings.migration.max_tokens})"
    return ""


async def _attempt(
    svc: RouterService,
    request: Request,
    ctx: RequestContext,
    req: RequestInfo,
    view: EndpointView,
    payload: bytes,
    headers: Mapping[str, str],
    resume: Progress | None = None,
) -> Relayed:
    """One attempt on the chosen endpoint, its accounting held by a lease; with `resume`,
    a continuation relayed into that broken stream."""
    name = "upstream" if resume is None else "upstream (continuation)"
    span, trace_headers = ctx.trace.upstream(name, view.id, view.endpoint.url)
    call = Call(
        endpoint=view.endpoint,
        path=PATHS[ctx.kind],
        payload=payload,
        stream=ctx.stream,
        strip_usage=ctx.strip_usage,
        served_model=req.model,
        total_at=ctx.deadline,
        response_headers={**ctx.response_headers, **headers},
        priority=ctx.priority,
        request_id=ctx.request_id,
        track=ctx.stream and svc.can_resume(view.endpoint),
        resume=resume,
        trace_headers=trace_headers,
    )
    attempt = Attempt(svc.registry, view, req)
    relayed = None
    error = ""
    try:
        with attempt as lease:
            relayed = await svc.proxy.run(request, call, lease)
            attempt.outcome = relayed.ending
        error = relayed.cause
        note = relayed.response.headers.get(TRANSFER_HEADER, "")
        if (why := fallback_reason(note)) is not None:  # the decode engine recomputed the KV
            svc.metrics.pd_fallbacks.labels("decode_" + why).inc()
        return relayed
    except AttemptFailed as exc:
        error = exc.cause
        raise
    finally:
        end_upstream(span, attempt.outcome, error)
        first = attempt.lease.first_byte_at if attempt.lease else None
        if resume is not None:  # the client's first byte came from an earlier leg
            first = None
        else:
            ctx.trace.served(req.model, None if first is None else first - ctx.started)
        svc.metrics.attempt_ended(
            req.model, attempt.outcome, ctx.started, first, relayed, attempt.lease.predicted
        )
        if first is not None:
            svc.load.ttft.add(req.model, first - ctx.started)  # the autoscaler's SLO signal


async def _disaggregate(
    svc: RouterService, ctx: RequestContext, req: RequestInfo, view: EndpointView, payload: bytes
) -> tuple[bytes, dict[str, str]]:
    """The decode replica `view`'s body and the P/D header: split (cgn_router/disagg.py), the
    prefill leg run and its KV named in the body; else the client's body, computed whole
    there. A failed prefill leg is a fallback (counted), never the request's failure."""
    uncached = max(0, req.prompt_tokens - view.matched_blocks * BLOCK_SIZE)
    pre = _route(svc, ctx, dataclasses.replace(req, role="prefill"), frozenset({view.id}))
    queue = None if pre is None else _queue(pre)
    split = decide(
        svc.settings.pd, prefill_pool=True, uncached_tokens=uncached, prefill_queue=queue
    )
    svc.metrics.pd_decisions.labels(req.model, split.reason).inc()
    if not split.split or pre is None:
        return payload, {PD_HEADER: f"aggregated: {split.reason}"}
    try:
        params = await _prefill_leg(svc, ctx, req, pre)
    except AttemptFailed as exc:
        svc.metrics.pd_fallbacks.labels(exc.cause).inc()
        log.warning(
            "prefill leg on %s failed, the decode replica computes it: %s", pre.id, exc.message
        )
        return payload, {PD_HEADER: f"aggregated: prefill leg failed ({exc.cause})"}
    return ctx.decode_leg(req.model, params), {PD_HEADER: f"disaggregated (prefill {pre.id})"}


def _queue(view: EndpointView) -> int:
    """Requests running and waiting on an endpoint: the engine's figures, or the router's own
    in-flight count where it has none fresh."""
    return view.in_flight if view.load is None else round(view.load.running + view.load.waiting)


async def _prefill_leg(
    svc: RouterService, ctx: RequestContext, req: RequestInfo, view: EndpointView
) -> dict[str, Any]:
    """Run the prompt on prefill replica `view`; the answer's `kv_transfer_params`."""
    deadline = min(ctx.deadline, time.monotonic() + svc.settings.pd.prefill_timeout_s)
    span, trace_headers = ctx.trace.upstream("prefill leg", view.id, view.endpoint.url)
    call = Call(
        endpoint=view.endpoint,
        path=PATHS[ctx.kind],
        payload=ctx.prefill_leg(req.model),
        stream=False,
        strip_usage=False,
        served_model=req.model,
        total_at=deadline,
        response_headers={},
        priority=ctx.priority,
        request_id=ctx.request_id,
        trace_headers=trace_headers,
    )
    attempt = Attempt(svc.registry, view, dataclasses.replace(req, role="prefill"))
    try:
        with attempt as lease:
            answer = await svc.proxy.exchange(call)
            lease.first_byte(time.monotonic())
            attempt.outcome = "ok"
    except AttemptFailed as exc:
        end_upstream(span, attempt.outcome, exc.cause)
        raise
    end_upstream(span, attempt.outcome)
    try:
        params = parse_transfer_params(answer.get(TRANSFER_FIELD))
    except InvalidRequest as exc:
        raise AttemptFailed("bad_answer", f"{view.id}: {exc.message}", breaker=False) from None
    if not params.do_remote_prefill:
        raise AttemptFailed("bad_answer", f"{view.id}: no KV named in the answer", breaker=False)
    return params.to_json()


COLD_POLL_S = 0.25


async def _cold_start(svc: RouterService, ctx: RequestContext) -> None:
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
            svc.metrics.requests.labels(model, "no_endpoint").inc()
            why = f"no replica of model '{model}' became ready within {hold:.0f} s"
            raise Unavailable(why, code="no_endpoint", retry_after_s=30)
        if now - noted >= WINDOW_S / 2:  # NOTE: the autoscaler counts the last minute's
            svc.load.unrouted.add(model, 1.0, now)
            noted = now
        await asyncio.sleep(COLD_POLL_S)


def _no_answer(svc: RouterService, model: str, last: AttemptFailed | None) -> CognitoraError:
    """The error for a request no endpoint answered: none to try, or every attempt failed."""
    if last is None:
        svc.load.unrouted.add(model, 1.0)  # demand for a pool with no replica (min 0)
        svc.metrics.requests.labels(model, "no_endpoint").inc()
        svc.metrics.errors.labels("no_endpoint").inc()
        return Unavailable(f"no ready endpoint serves model '{model}'", code="no_endpoint")
    svc.metrics.requests.labels(model, "upstream_error").inc()
    if last.timeout:
        return UpstreamTimeout(f"no engine answered in time: {last.message}", code=last.cause)
    return BadGateway(f"no engine could serve the request: {last.message}", code=last.cause)


async def _hash_off_loop(
    svc: RouterService, kind: str, model: str, body: dict[str, Any], size: int
) -> HashedPrompt:
    """`_hash`, on a worker thread when the body is big enough to stall other streams."""
    if size < OFF_LOOP_BYTES:
        return _hash(svc, kind, model, body)
    return await asyncio.to_thread(_hash, svc, kind, model, body)


def _hash(svc: RouterService, kind: str, model: str, body: Mapping[str, Any]) -> HashedPrompt:
    if kind == "embeddings":
        return HashedPrompt((), 0, "none")
    hashed = svc.catalog.hasher(model).hash(kind, body)
    svc.metrics.hashed.labels(model, hashed.method).inc()
    return hashed


async def _models(svc: RouterService, request: Request) -> Reply:
    who = svc.principal(
        request.headers.get("Authorization")
    )  # listing models needs a key too, as on OpenAI's API
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
    return Reply.json({"object": "list", "data": data})
