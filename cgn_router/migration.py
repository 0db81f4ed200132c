"""Request migration: a stream that broke mid-answer continues on another replica of the same
model and engine kind, from the token ids the client has the text of, at most the model's
migration limit in all; or it ends, saying why not. cgn-infer names the ids it streams and
takes them back (cgn_core/openai/resume.py); vLLM names them when asked and llama.cpp
streams text only (re-tokenized): both are continued as a `/v1/completions` of token ids,
rewritten as the client's stream (cgn_core/openai/continuation.py)."""

from __future__ import annotations

import json
import logging
import time

from cgn_core.h1 import Request
from cgn_core.openai import continuation
from cgn_core.openai.continuation import Rewriter
from cgn_router.context import RequestContext
from cgn_router.legs import attempt, route
from cgn_router.proxy import RETURN_IDS_ENGINES, AttemptFailed, Relayed
from cgn_router.routing.lifecycle import Account, Migrated
from cgn_router.service import RouterService
from cgn_router.tracked import Progress
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
        path, translate, payload = None, None, b""
        try:
            if broken.events is not None:  # an engine that streams text only
                payload, translate, generated, tokens = _from_text(svc, ctx, req, broken)
                path = "/v1/completions"
            else:
                resume = broken.resume_field()
                generated = len(resume["token_ids"])
                tokens = req.prompt_tokens + generated
            why = _no_migration(svc, ctx, tokens, tries, limit)
        except ValueError as exc:
            resume, generated = {}, 0
            why = str(exc) if broken.events is not None else (
                f"the stream cannot be continued from what it sent ({exc})"
            )  # fmt: skip
        others = frozenset(tried | svc.cannot_resume(req.model, broken.engine))
        view = None if why else route(svc, req, others, acct)
        if not why and view is None:
            why = f"no other replica of {req.model} can continue it"
        if why or view is None:
            acct.emit(Migrated(req.model, relayed.cause, "not_continued", broken.engine))
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
        if path is None:
            payload = ctx.resume_payload(req.model, resume)
        try:
            after = await attempt(
                svc, request, ctx, req, view, payload, {}, acct, broken,
                path=path, translate=translate,
            )  # fmt: skip
        except AttemptFailed as exc:  # the continuation did not start: another may
            log.info("continuation failed: %s", exc.message)
            acct.emit(Migrated(req.model, relayed.cause, "failed", broken.engine))
            continue
        acct.emit(Migrated(req.model, relayed.cause, "continued", broken.engine))
        relayed = after
    return relayed


def _from_text(
    svc: RouterService, ctx: RequestContext, req: RequestInfo, broken: Progress
) -> tuple[bytes, Rewriter, int, int]:
    """A continuation of a text-only stream (cgn_core/openai/continuation.py): its
    `/v1/completions` body, the rewriter of its events, the answer's tokens so far and the
    prompt's and answer's together; ValueError saying why it cannot be continued."""
    if why := continuation.refusal(ctx.body):
        raise ValueError(why)
    if broken.overflowed or broken.events is None:
        raise ValueError("the answer is too long to continue from its text")
    codec = svc.catalog.hasher(req.model).codec
    so_far = continuation.answer_so_far(broken.events, ctx.kind)
    if so_far.ids is not None:  # the engine named them (vLLM): checked where it can be
        ids, prompt = continuation.streamed_ids(so_far, codec.tokenizer if codec else None)
    elif codec is None:
        raise ValueError("the router has no tokenizer for this model")
    else:
        ids, prompt = continuation.continuation_ids(
            codec, codec.tokenizer, ctx.kind, ctx.body, so_far.text
        )
    generated = len(ids) - prompt
    named = broken.engine in RETURN_IDS_ENGINES
    body = continuation.continuation_body(ctx.body, req.model, ids, generated, named)
    rewriter = Rewriter(ctx.kind, so_far, req.model, prompt, generated)
    return json.dumps(body).encode(), rewriter, generated, len(ids)


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
