"""Request migration: a stream that broke mid-answer continues on another replica of the same
model, from the token ids the client has the text of (cgn_core/openai/resume.py), at most
the model's migration limit in all; or it ends, saying why not."""

from __future__ import annotations

import logging
import time

from cgn_core.h1 import Request
from cgn_router.context import RequestContext
from cgn_router.legs import attempt, route
from cgn_router.proxy import AttemptFailed, Relayed
from cgn_router.routing.lifecycle import Account, Migrated
from cgn_router.service import RouterService
from cgn_router.types import EndpointId, RequestInfo

log = logging.getLogger(__name__)


async def migrate(
    svc: RouterService,
    request: Request,
    ctx: RequestContext,
    req: RequestInfo,
    relayed: Relayed,
    tried: set[EndpointId],
    acct: Account,
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
        view = None if why else route(svc, req, others, acct)
        if not why and view is None:
            why = f"no other replica of {req.model} can continue it"
        if why or view is None:
            acct.emit(Migrated(req.model, relayed.cause, "not_continued"))
            log.warning("a stream of %s broke (%s), not continued: %s", req.model, broken.why, why)
            return await svc.proxy.end(relayed, why)
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
            after = await attempt(svc, request, ctx, req, view, payload, {}, acct, broken)
        except AttemptFailed as exc:  # the continuation did not start: another may
            log.info("continuation failed: %s", exc.message)
            acct.emit(Migrated(req.model, relayed.cause, "failed"))
            continue
        acct.emit(Migrated(req.model, relayed.cause, "continued"))
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
