"""Request migration: a stream that broke mid-answer continues on another replica of the same
model and engine kind, from the token ids the client has the text of, at most the model's
migration limit in all; or it ends, saying why not. cgn-infer names the ids it streams and
takes them back (cgn_core/openai/resume.py); vLLM names them when asked, and llama.cpp,
SGLang and TensorRT-LLM stream text only (re-tokenized): these are continued as a
`/v1/completions` of token ids, rewritten as the client's stream
(cgn_core/openai/continuation.py). A model with `migrate_across_engines` may continue on
any engine kind that takes such a prompt (cgn-infer's streams too, from their text, when no
cgn-infer replica can take them)."""

from __future__ import annotations

import json
import logging
import time

from cgn_core.h1 import Request
from cgn_core.openai import continuation
from cgn_core.openai.continuation import Rewriter
from cgn_router.context import RequestContext
from cgn_router.legs import attempt, route
from cgn_router.proxy import AttemptFailed, Relayed
from cgn_router.routing.lifecycle import Account, Migrated
from cgn_router.service import RESUMABLE_ENGINES, RouterService
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
    across = svc.across_engines(req.model)
    tries = 0
    while (broken := relayed.broken) is not None:
        path, translate, payload, resume, generated = None, None, b"", {}, 0
        view, why = None, ""
        try:
            if broken.events is None or broken.engine in RESUMABLE_ENGINES:
                # cgn-infer on cgn-infer: its own ids and state (`cgn_resume`)
                resume = broken.resume_field()
                generated = len(resume["token_ids"])
                why = _no_migration(svc, ctx, req.prompt_tokens + generated, tries, limit)
                if not why:
                    others = tried | svc.cannot_resume(req.model, broken.engine)
                    view = route(svc, req, frozenset(others), acct)
            if view is None and not why and broken.events is not None:
                # another engine's stream, or (`across`, its events kept) cgn-infer's with no
                # cgn-infer to take it: a `/v1/completions` of its ids
                payload, translate, generated, tokens = _from_text(svc, ctx, req, broken)
                path = "/v1/completions"
                why = _no_migration(svc, ctx, tokens, tries, limit)
                if not why:
                    others = tried | svc.cannot_resume(req.model, broken.engine, across)
                    view = route(svc, req, frozenset(others), acct)
        except ValueError as exc:
            why = str(exc) if broken.events is not None else (
                f"the stream cannot be continued from what it sent ({exc})"
            )  # fmt: skip
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
    # NOTE: the proxy asks a vLLM replica to name its ids (RETURN_IDS_ENGINES) whichever
    # engine the stream came from
    body = continuation.continuation_body(ctx.body, req.model, ids, generated)
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
