"""One leg of a request on one endpoint: routed by the chain, run through the proxy under a
lease, and accounted as records (cgn_router/routing/lifecycle.py): the client's answer (`attempt`,
also a migrated stream's continuation), and for a model with a prefill pool the P/D split
(`disaggregate`: cgn_router/routing/disagg.py decides, `prefill_leg` runs the first leg)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cgn_core.errors import InvalidRequest
from cgn_core.h1 import Request
from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.kv.transfer import FIELD as TRANSFER_FIELD
from cgn_core.kv.transfer import HEADER as TRANSFER_HEADER
from cgn_core.kv.transfer import fallback_reason, parse_transfer_params
from cgn_router.attempt import Attempt
from cgn_router.context import RequestContext
from cgn_router.hold import HOLD_MAX_S
from cgn_router.proxy import AttemptFailed, Call, Relayed
from cgn_router.registry import Lease
from cgn_router.routing.chain import Decision
from cgn_router.routing.disagg import costs, decide
from cgn_router.routing.lifecycle import (
    Account,
    AttemptEnded,
    Held,
    PdDecided,
    PdFallback,
    Routed,
)
from cgn_router.service import RouterService
from cgn_router.tracked import Progress
from cgn_router.types import EndpointId, EndpointView, RequestInfo

log = logging.getLogger(__name__)
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
PD_HEADER = "x-cognitora-pd"  # disaggregated (prefill <endpoint>), or aggregated: why
PREDICTED_HEADER = "x-cognitora-predicted-ttft-ms"  # the chosen replica's, a time scorer's
HELD_HEADER = "x-cognitora-held-ms"  # waited at the router for a replica to meet the TTFT SLO
# A stream routed by predicted time that waits for its first token MOVE_LAG times what its
# replica's speed predicts for it (and MOVE_MIN_S at least) is moved where a fresh start is
# predicted sooner than it has waited already (checked every MOVE_CHECK_S), while that
# replica has answered fewer than MOVE_UNLEARNED streams (its speed a guess: once learned,
# a late stream is queueing that the prediction saw, and moving it wastes its work); the
# time a moved stream waited is learned as its first token's (a lower bound: Lease.late)
MOVE_LAG = 4.0
MOVE_UNLEARNED = 3
MOVE_MIN_S = 1.0
MOVE_CHECK_S = 0.25


async def held(
    svc: RouterService, ctx: RequestContext, req: RequestInfo, view: EndpointView, acct: Account
) -> tuple[EndpointView | None, dict[str, str]]:
    """`view`, or the replica that meets the model's TTFT SLO soonest after `req` waited for
    one (cgn_router/hold.py; None: none is left), and the response header saying so."""
    entry = svc.catalog.entry(req.model)
    if not svc.settings.routing.hold_for_slo or entry is None or entry.ttft_slo_s is None:
        return view, {}
    if view.predicted_ttft_s is None:
        return view, {}
    band = svc.settings.admission.bands.get(ctx.band)
    until = min(ctx.deadline, time.monotonic() + (band.ttl_s if band else HOLD_MAX_S))
    started = time.monotonic()
    try:
        got = await svc.holds.hold(
            req, view, entry.ttft_slo_s, until, lambda: svc.route(req, frozenset()).view
        )
    except asyncio.CancelledError:
        acct.emit(Held(req.model, time.monotonic() - started, "gone"))
        raise
    if got is None:
        return view, {}
    _, waited, result = got
    acct.emit(Held(req.model, waited, result))
    # the decision it goes with, on the record
    return route(svc, req, frozenset(), acct), {HELD_HEADER: str(round(waited * 1000))}


def route(
    svc: RouterService, req: RequestInfo, tried: frozenset[EndpointId], acct: Account
) -> EndpointView | None:
    """The endpoint the chain picks (None: no candidate left)."""
    return route_decision(svc, req, tried, acct).view


def route_decision(
    svc: RouterService, req: RequestInfo, tried: frozenset[EndpointId], acct: Account
) -> Decision:
    """The chain's decision, every candidate's total with it, on the record (Routed)."""
    started = time.perf_counter_ns()
    decision = svc.route(req, tried)
    took = time.perf_counter_ns() - started
    acct.emit(Routed(req.model, req.role, decision, svc.chain.weights, took))
    return decision


async def attempt(
    svc: RouterService,
    request: Request,
    ctx: RequestContext,
    req: RequestInfo,
    view: EndpointView,
    payload: bytes,
    headers: Mapping[str, str],
    acct: Account,
    resume: Progress | None = None,
    tried: frozenset[EndpointId] | None = None,
    path: str | None = None,
    translate: Callable[[bytes], list[bytes]] | None = None,
) -> Relayed:
    """One attempt on the chosen endpoint, its accounting held by a lease; with `resume`,
    a continuation relayed into that broken stream. `tried` (the endpoints this request
    tried, this one included; None: it has no attempt left): a stream routed by predicted
    time may be moved before its first token (`_moved_when_late`). `path` and `translate`:
    a continuation in another API than the client's (cgn_core/openai/continuation.py)."""
    name = "upstream" if resume is None else "upstream (continuation)"
    number, trace_headers = acct.attempt(name, view.id, view.endpoint.url)
    call = Call(
        endpoint=view.endpoint,
        path=path or PATHS[ctx.kind],
        payload=payload,
        stream=ctx.stream,
        strip_usage=ctx.strip_usage,
        served_model=req.model,
        total_at=ctx.deadline,
        response_headers={**ctx.response_headers, **headers, **_predicted(view)},
        priority=ctx.priority,
        kv_salt=ctx.kv_salt,
        adapter=ctx.adapter,
        request_id=ctx.request_id,
        track=(track := ctx.stream and svc.can_resume(view.endpoint)),
        resume=resume,
        trace_headers=trace_headers or None,
        keep_events=track and svc.text_resumed(view.endpoint),
        translate=translate,
    )
    held = Attempt(svc.registry, view, req, streamed=ctx.stream and resume is None)
    relayed = None
    cause = ""
    try:
        with held as lease:
            relaying = svc.proxy.run(request, call, lease)
            if tried is not None and ctx.stream and view.predicted_ttft_s is not None:
                relaying = _moved_when_late(svc, req, view, lease, relaying, tried)
            relayed = await relaying
            held.outcome = relayed.ending
        cause = relayed.cause
        note = relayed.response.headers.get(TRANSFER_HEADER, "")
        if (why := fallback_reason(note)) is not None:  # the decode engine recomputed the KV
            acct.emit(PdFallback("decode_" + why))
        return relayed
    except AttemptFailed as exc:
        cause = exc.cause
        raise
    finally:
        # NOTE: a continuation's client had its first byte from an earlier leg
        first = held.lease.first_byte_at if resume is None else None
        since = None if first is None else first - ctx.started
        usage, broken = (
            (None, False) if relayed is None else (relayed.usage, relayed.broken is not None)
        )
        ended = (number, req.model, "client", held.outcome, cause, since, usage)
        # NOTE: a whole answer's first byte is its last: only a stream shows its first token
        timed = held.outcome == "ok" and not broken and ctx.stream
        sample = held.lease.sample(usage) if timed else None
        if cause == "moved":  # no first token in all that time: at least that slow
            sample = held.lease.late()
        mine = (view.id, view.endpoint.engine, view.predicted_ttft_s, sample)
        acct.emit(AttemptEnded(*ended, held.lease.predicted, broken, *mine))


async def _moved_when_late(
    svc: RouterService,
    req: RequestInfo,
    view: EndpointView,
    lease: Lease,
    relaying: Awaitable[Relayed],
    tried: frozenset[EndpointId],
) -> Relayed:
    """`relaying`, or AttemptFailed("moved") while it has no first token, on a replica whose
    speed is not yet learned: once it has waited MOVE_LAG times what that replica's speed
    (its peers', as a guess) predicts for it, and a replica it has not tried is predicted
    to answer a fresh start sooner than it has waited already.
    (Nothing has reached the client: the caller tries that replica. Issue #57, part 3.)"""
    if lease.state.fit.count >= MOVE_UNLEARNED:
        return await relaying
    task = asyncio.ensure_future(relaying)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=MOVE_CHECK_S)
            if done or lease.first_byte_at is not None:
                return await task
            now = time.monotonic()
            waited = now - lease.began_at
            expected = lease.expected(svc.registry.speed(lease.state, now))
            if waited < max(MOVE_MIN_S, MOVE_LAG * expected):
                continue
            elsewhere = svc.route(req, tried)
            if elsewhere.predicted_ttft_s is None or elsewhere.predicted_ttft_s >= waited:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, AttemptFailed):
                await task
            why = (f"{view.id}: no first token in {waited:.1f} s (predicted {expected:.2f} s); "
                   f"{elsewhere.chosen} predicts {elsewhere.predicted_ttft_s:.2f} s")  # fmt: skip
            raise AttemptFailed("moved", why, breaker=False)
    finally:
        if not task.done():  # this request was cancelled (its client left)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def disaggregate(
    svc: RouterService,
    ctx: RequestContext,
    req: RequestInfo,
    view: EndpointView,
    payload: bytes,
    acct: Account,
) -> tuple[bytes, dict[str, str]]:
    """The decode replica `view`'s body and the P/D header: split (routing/disagg.py), the
    prefill leg run and its KV named in the body; else the client's body, computed whole
    there. A failed prefill leg is a fallback (counted), never the request's failure."""
    uncached = max(0, req.prompt_tokens - view.matched_blocks * BLOCK_SIZE)
    pre = route(svc, dataclasses.replace(req, role="prefill"), frozenset({view.id}), acct)
    queue = None if pre is None else _queue(pre)
    predicted = None
    if pre is not None:
        predicted = costs(view, pre, uncached, svc.settings.pd.transfer_s_per_token)
    split = decide(
        svc.settings.pd,
        prefill_pool=True,
        uncached_tokens=uncached,
        prefill_queue=queue,
        predicted=predicted,
    )
    acct.emit(PdDecided(req.model, split.reason))
    if not split.split or pre is None:
        return payload, {PD_HEADER: f"aggregated: {split.reason}"}
    try:
        params = await prefill_leg(svc, ctx, req, pre, acct)
    except AttemptFailed as exc:
        acct.emit(PdFallback(exc.cause))
        log.warning(
            "prefill leg on %s failed, the decode replica computes it: %s", pre.id, exc.message
        )
        return payload, {PD_HEADER: f"aggregated: prefill leg failed ({exc.cause})"}
    return ctx.decode_leg(req.model, params), {PD_HEADER: f"disaggregated (prefill {pre.id})"}


def _queue(view: EndpointView) -> int:
    """Requests running and waiting on an endpoint: the engine's figures, or the router's own
    in-flight count where it has none fresh."""
    return view.in_flight if view.load is None else round(view.load.running + view.load.waiting)


async def prefill_leg(
    svc: RouterService, ctx: RequestContext, req: RequestInfo, view: EndpointView, acct: Account
) -> dict[str, Any]:
    """Run the prompt on prefill replica `view`; the answer's `kv_transfer_params`."""
    deadline = min(ctx.deadline, time.monotonic() + svc.settings.pd.prefill_timeout_s)
    number, trace_headers = acct.attempt("prefill leg", view.id, view.endpoint.url)
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
        kv_salt=ctx.kv_salt,
        adapter=ctx.adapter,
        request_id=ctx.request_id,
        trace_headers=trace_headers or None,
    )
    held = Attempt(svc.registry, view, dataclasses.replace(req, role="prefill"))
    cause = ""
    try:
        with held as lease:
            answer = await svc.proxy.exchange(call)
            lease.first_byte(time.monotonic())
            held.outcome = "ok"
    except AttemptFailed as exc:
        cause = exc.cause
        raise
    finally:
        acct.emit(AttemptEnded(number, req.model, "prefill", held.outcome, cause))
    try:
        params = parse_transfer_params(answer.get(TRANSFER_FIELD))
    except InvalidRequest as exc:
        raise AttemptFailed("bad_answer", f"{view.id}: {exc.message}", breaker=False) from None
    if not params.do_remote_prefill:
        raise AttemptFailed("bad_answer", f"{view.id}: no KV named in the answer", breaker=False)
    return params.to_json()


def _predicted(view: EndpointView) -> dict[str, str]:
    """The response header with the chain's predicted time to first token, where it made one."""
    if view.predicted_ttft_s is None:
        return {}
    return {PREDICTED_HEADER: str(round(view.predicted_ttft_s * 1000))}
