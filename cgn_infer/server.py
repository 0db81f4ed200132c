"""cgn-infer's HTTP edge: the OpenAI surface, /health and /metrics on aiohttp.

The model runs on the engine's worker thread; handlers only parse, queue and
relay. A client that disconnects cancels its generation. Every error reaches
the client as an OpenAI-style JSON body with a 4xx/5xx status, never a
traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cgn_core.errors import (
    CognitoraError,
    Forbidden,
    InternalError,
    InvalidRequest,
    NotFound,
    Unavailable,
    openai_error_body,
)
from cgn_core.http import (
    KV_SALT_HEADER,
    PRIORITY_HEADER,
    bearer_middleware,
    error_middleware,
    mtls_middleware,
    parse_json,
    read_body,
    serve_sse,
)
from cgn_core.kv.blockhash import MAX_SALT, adapter_salt, valid_salt
from cgn_core.kv.events import KvEventHub
from cgn_core.kv.transfer import FIELD as TRANSFER_FIELD
from cgn_core.kv.transfer import HEADER as TRANSFER_HEADER
from cgn_core.kv.transfer import TransferParams
from cgn_core.openai.resume import FIELD as RESUME_FIELD
from cgn_core.openai.resume import IDS_HEADER, ids_line
from cgn_core.text.prompt import PromptCodec
from cgn_core.tracing import Tracer
from cgn_infer import lora_api
from cgn_infer.adapters import Adapters
from cgn_infer.detokenizer import IncrementalText
from cgn_infer.engine import Engine, Job
from cgn_infer.events import Event, FinishEvent, GenerationRequest, TokenEvent
from cgn_infer.grammar import Grammars
from cgn_infer.metrics import EngineMetrics
from cgn_infer.protocol import (
    Kind,
    ParsedRequest,
    check_vocabulary,
    parse_request,
    token_budget,
)
from cgn_infer.responses import ResponseBuilder
from cgn_infer.scheduler import Restored
from cgn_infer.trace import GenerationTrace
from cgn_infer.transfer import TransferSink, TransferSource

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
OFF_LOOP_BYTES = 64 << 10  # bodies from this size on are tokenized on a worker thread


@dataclass(frozen=True, slots=True)
class Serving:
    """Everything that exists once the weights are loaded, built whole by the daemon."""

    engine: Engine
    codec: PromptCodec
    grammars: Grammars | None  # structured outputs; None: refused with a 400
    ctx: int  # the engine's context length
    kv_capacity: int  # KV slots one request may use
    role: str = "both"  # both | prefill | decode (prefill/decode disaggregation)
    engine_id: str = ""  # this engine's name in a prefill leg's answer
    transfer_source: TransferSource | None = None  # holds prefill legs' KV (role != decode)
    transfer_sink: TransferSink | None = None  # fetches decode legs' KV (role != prefill)
    adapters: Adapters | None = None  # the LoRA adapters it serves (--lora, run-time loads)
    lora_dirs: tuple[Path, ...] = ()  # where run-time loads may read adapter files


@dataclass(slots=True)
class InferenceService:
    """One engine's HTTP side: loading until `serve(Serving)`, then serving; nothing else of
    it changes after construction."""

    model_name: str
    metrics: EngineMetrics
    kv_events: KvEventHub
    body_timeout_s: float = 60.0  # a request body must arrive within this
    created: int = field(default_factory=lambda: int(time.time()))
    serving: Serving | None = None  # None while the model loads
    tracer: Tracer | None = None  # OpenTelemetry spans; None when tracing is off

    def serve(self, serving: Serving) -> None:
        """The model is loaded: from now on requests run (once; a service never reloads)."""
        assert self.serving is None, "a service is given its engine once"
        self.serving = serving
        if serving.adapters is not None:
            self.metrics.lora_slots.set(serving.adapters.slots)
            for name in serving.adapters.listing():
                self.metrics.lora_loaded.set(name)

    def ready(self) -> Serving:
        """What serves requests; Unavailable (503) while the model loads."""
        if self.serving is None:
            raise Unavailable("the model is still loading")
        return self.serving

    def prepare(self, req: ParsedRequest) -> GenerationRequest:
        """Template, tokenize and bound a validated request."""
        serving = self.ready()
        self._check_adapter(req, serving)
        if req.kind == "chat":
            prompt = serving.codec.encode_chat(req.messages, req.tools.rendered)
        elif req.prompt_text is not None:
            prompt = serving.codec.encode_text(req.prompt_text)
        else:
            prompt = list(req.prompt_ids or ())
        check_vocabulary(req, prompt, serving.codec.tokenizer.vocab_size)
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        resumed = req.resume.token_ids if req.resume is not None else ()
        n = len(prompt) + len(resumed)
        max_tokens = token_budget(req, n, len(resumed), serving.ctx, serving.kv_capacity)
        constraint = None
        if req.grammar is not None:
            if serving.grammars is None:
                raise InvalidRequest(
                    f"'{req.grammar.origin}' is not supported by this engine",
                    param=req.grammar.origin,
                )
            compiled = self.metrics.grammar_compile_seconds.observe
            constraint = serving.grammars.resumed(req.grammar, resumed, compiled)
            self.metrics.constrained.inc()
        transfer = req.kv_transfer
        lora = None  # NOTE: held last: nothing below refuses the request (`release` frees it)
        if req.model != self.model_name and serving.adapters is not None:
            lora = serving.adapters.acquire(req.model, req.lora_scale)
        return GenerationRequest(
            constraint=constraint,
            export_kv=transfer is not None and transfer.do_remote_decode,
            prompt=tuple(prompt),
            resumed=tuple(resumed),
            params=req.params,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            priority=req.priority,
            # an adapter's blocks in a namespace of their own (the router hashes alike)
            salt=adapter_salt(req.kv_salt, req.model if lora else None, req.lora_scale),
            lora=lora,
        )

    def _check_adapter(self, req: ParsedRequest, serving: Serving) -> None:
        """NotFound for a `model` that is neither the model nor a loaded adapter; 400 for a
        `lora_scale` on the model itself."""
        if req.model == self.model_name:
            if req.lora_scale != 1.0:
                raise InvalidRequest(f"'lora_scale' scales a LoRA adapter: '{req.model}' is "
                                     "the model", param="lora_scale")  # fmt: skip
            return
        if serving.adapters is None:
            raise NotFound(
                f"model '{req.model}' is not served here (this engine serves '{self.model_name}')",
                code="model_not_found",
                param="model",
            )
        serving.adapters.check(req.model)

    def check_transfer(self, params: TransferParams | None, trusted: bool) -> None:
        """Refuse a leg this engine's role cannot run, or one from an untrusted caller (a
        decode leg makes the engine dial the address it names)."""
        if params is None:
            return
        serving = self.ready()
        if not trusted:
            raise Forbidden(
                f"'{TRANSFER_FIELD}' is accepted from the router only", param=TRANSFER_FIELD
            )
        if params.do_remote_decode and serving.transfer_source is None:
            raise InvalidRequest(
                f"this engine's role is {serving.role}: it runs no prefill legs",
                param=f"{TRANSFER_FIELD}.do_remote_decode",
            )
        if params.do_remote_prefill and serving.transfer_sink is None:
            raise InvalidRequest(
                f"this engine's role is {serving.role}: it runs no decode legs",
                param=f"{TRANSFER_FIELD}.do_remote_prefill",
            )

    async def restore(
        self,
        gen: GenerationRequest,
        params: TransferParams | None,
        trace: GenerationTrace = GenerationTrace.OFF,
    ) -> tuple[Restored | None, str | None]:
        """Prompt blocks fetched before the request is queued (off the loop): from the prefill
        engine a decode leg names, else from the node's KV store; and the transfer's note.
        Where it looks at all, `trace` gets a KV restore span (its context goes to kvcached)."""
        serving = self.ready()
        loop, engine = asyncio.get_running_loop(), serving.engine
        transfer = params is not None and params.do_remote_prefill
        sink = serving.transfer_sink if transfer else None
        if sink is None and engine.tiering is None:
            return None, None
        span, context = trace.restoring()
        note = None
        if sink is not None:
            assert params is not None  # a sink is chosen only for a decode leg's params
            fetched = await loop.run_in_executor(
                engine.restore_executor, sink.fetch, gen.prompt, params, gen.salt
            )
            restored, note = fetched.restored, fetched.note
        else:  # fetch what the node's KV store has, off the loop
            assert engine.tiering is not None
            prefetch = engine.tiering.prefetch
            restored = await loop.run_in_executor(
                engine.restore_executor, prefetch, gen.prompt, context, gen.salt
            )
        trace.restored(span, restored, note)
        return restored, note

    async def generate(
        self,
        gen: GenerationRequest,
        restored: Restored | None = None,
        trace: GenerationTrace = GenerationTrace.OFF,
    ) -> AsyncIterator[Event]:
        """Run `gen` on the engine; cancelling the consumer cancels the generation."""
        engine = self.ready().engine
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def arrived(ev: Event) -> None:  # on the loop, consumer or not (a cancelled job ends)
            if isinstance(ev, FinishEvent) and ev.stats is not None:
                self.metrics.finished(ev.stats)
            events.put_nowait(ev)

        def emit(ev: Event) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(arrived, ev)

        job = Job(gen, emit, restored=restored)
        engine.submit(job)
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, FinishEvent) and ev.stats is not None:
                    trace.generated(ev.stats, ev)
                yield ev
                if isinstance(ev, FinishEvent):
                    return
        finally:
            job.cancelled.set()


OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers need no token


def build_app(
    svc: InferenceService, api_token: str = "", client_certs: bool = False
) -> web.Application:
    """The engine's HTTP surface; with `api_token`, /v1/* answers only bearers of it, and with
    `client_certs` (an HTTPS listener) only callers with a certificate from the cluster CA."""
    middlewares = [error_middleware(MAX_BODY_BYTES, lambda _: svc.metrics.rejected.inc())]
    if client_certs:
        middlewares.append(mtls_middleware(OPEN_PATHS))
    if api_token:
        middlewares.append(bearer_middleware(api_token, OPEN_PATHS))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app.router.add_post("/v1/chat/completions", lambda r: _complete(svc, r, "chat"))
    app.router.add_post("/v1/completions", lambda r: _complete(svc, r, "completion"))
    app.router.add_get("/v1/models", lambda r: _models(svc))
    lora_api.add_routes(app, svc)
    app.router.add_get("/v1/kv/events", lambda r: serve_sse(svc.kv_events, r))
    app.router.add_get("/health", lambda r: _health(svc))
    app.router.add_get("/metrics", lambda r: _metrics(svc))
    return app


async def _complete(svc: InferenceService, request: web.Request, kind: Kind) -> web.StreamResponse:
    trace = GenerationTrace.start(svc.tracer, kind, svc.model_name, request.headers)
    try:
        resp = await _complete_traced(svc, request, kind, trace)
    except CognitoraError as err:
        trace.finish(err.http_status, err.code or type(err).__name__)
        raise
    except BaseException as exc:  # a bug (a 500), or the client left
        trace.finish(500, type(exc).__name__)
        raise
    trace.finish(resp.status)
    return resp


async def _complete_traced(
    svc: InferenceService, request: web.Request, kind: Kind, trace: GenerationTrace
) -> web.StreamResponse:
    raw = await read_body(request, svc.body_timeout_s)
    parsed = parse_request(kind, parse_json(raw))
    # NOTE: the router's priority jumps queues: trusted only from a caller holding the token
    # (or from anyone while the engine runs without one: development, logged at start).
    trusted = request.get("authenticated", True)
    if (header := request.headers.get(PRIORITY_HEADER)) is not None and trusted:
        parsed = dataclasses.replace(parsed, priority=_priority(header))
    # NOTE: so is the tenant's KV salt; an untrusted caller's is ignored, and its blocks are
    # the unsalted namespace's, which no router-sent (salted) tenant's ever are
    if (header := request.headers.get(KV_SALT_HEADER)) is not None and trusted:
        parsed = dataclasses.replace(parsed, kv_salt=_kv_salt(header))
    svc.check_transfer(parsed.kv_transfer, trusted)
    if parsed.resume is not None and not trusted:
        raise Forbidden(f"'{RESUME_FIELD}' is accepted from the router only", param=RESUME_FIELD)
    serving = svc.ready()  # 503 while the model loads
    gen = await _prepared(svc, parsed, len(raw), trace)
    try:  # a request holds its adapter until it ends, however it ends
        return await _generated(svc, request, parsed, gen, serving, trace)
    finally:
        if gen.lora is not None and serving.adapters is not None:
            serving.adapters.release(parsed.model)


async def _generated(
    svc: InferenceService,
    request: web.Request,
    parsed: ParsedRequest,
    gen: GenerationRequest,
    serving: Serving,
    trace: GenerationTrace,
) -> web.StreamResponse:
    trusted = request.get("authenticated", True)
    restored, note = await svc.restore(gen, parsed.kv_transfer, trace)
    headers = {TRANSFER_HEADER: note} if note else {}
    build = ResponseBuilder(
        parsed.kind,
        parsed.model,  # the model's name, or its adapter's
        serving.codec.tokenizer.token_text,
        parsed.params.logprobs is not None,
        tools=parsed.tools,
    )
    ended = None  # a continuation of an answer that had ended: only its end was missing
    if parsed.resume is not None:
        seen, ended = _replay(serving.engine.tokenizer, gen)
        build.resume(parsed.resume, seen)
    events = svc.generate(gen, restored, trace) if ended is None else _just(ended)
    if not parsed.stream:
        return web.json_response(await _answer(svc, events, build), headers=headers)
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    # token ids on the stream, for the router to continue it elsewhere if this engine goes
    with_ids = trusted and request.headers.get(IDS_HEADER) == "1"
    await _stream(resp, events, build, with_ids, parsed.include_usage)
    return resp


async def _prepared(
    svc: InferenceService, parsed: ParsedRequest, size: int, trace: GenerationTrace
) -> GenerationRequest:
    """`svc.prepare`, off the loop where it is slow: templating and tokenizing a long prompt,
    or compiling a grammar, would stall every other stream."""
    grammars = svc.ready().grammars
    compiles = (
        parsed.grammar is not None and grammars is not None and not grammars.cached(parsed.grammar)
    )
    began = trace.clock()
    if size < OFF_LOOP_BYTES and not compiles:
        gen = svc.prepare(parsed)
    else:
        gen = await asyncio.to_thread(svc.prepare, parsed)
    trace.step("prepare", began, **{"grammar.compiled": compiles})
    return gen


async def _answer(
    svc: InferenceService, events: AsyncIterator[Event], build: ResponseBuilder
) -> dict[str, Any]:
    """A whole answer's body; a prefill leg's says where its KV blocks are held."""
    async for ev in events:
        if isinstance(ev, TokenEvent):
            build.add(ev)
        elif ev.reason == "error":
            raise _generation_error(ev)
        else:
            body = build.final(ev)
            serving = svc.ready()
            if ev.exported is not None and (source := serving.transfer_source) is not None:
                body[TRANSFER_FIELD] = await source.hand_over(ev.exported, serving.engine_id)
                svc.metrics.kv_transfer_held.inc(len(ev.exported.hashes))
            return body
    raise InternalError("generation ended without a result")


async def _stream(
    resp: web.StreamResponse,
    events: AsyncIterator[Event],
    build: ResponseBuilder,
    with_ids: bool,
    include_usage: bool,
) -> None:
    """An answer as server-sent events; `with_ids`: each token's id goes before its text."""
    if (first := build.first_chunk()) is not None:
        await _send(resp, first)
    ids: list[int] = []  # generated since the last ids line (with_ids)
    async for ev in events:
        if isinstance(ev, TokenEvent):
            chunks = build.token_chunks(ev)
            if not with_ids:
                for chunk in chunks:
                    await _send(resp, chunk)
                continue
            ids.append(ev.sampled.token)
            if chunks:  # NOTE: one write: a kill cannot leave half of a token's events out
                await resp.write(ids_line(ids) + b"".join(map(_event, chunks)))
                ids.clear()
            continue
        if ev.reason == "error":
            await _send(resp, openai_error_body(_generation_error(ev)))
        else:
            last = build.finish_chunks(ev)
            if with_ids and ids:  # text held back until the end: its ids go with it
                await resp.write(ids_line(ids) + b"".join(map(_event, last)))
            else:
                for chunk in last:
                    await _send(resp, chunk)
            if include_usage:
                await _send(resp, build.usage_chunk(ev))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


def _generation_error(ev: FinishEvent) -> CognitoraError:
    """A generation's error: the request's grammar could not go on (a 400), else a 500."""
    if ev.client_fault:
        return InvalidRequest(str(ev.error), code="constraint_failed")
    return InternalError(f"generation failed: {ev.error}")


def _kv_salt(header: str) -> str:
    """The router's KV salt for this request: a bounded token, else a 400."""
    salt = header.strip()
    if not valid_salt(salt):
        raise InvalidRequest(
            f"{KV_SALT_HEADER} must be 1-{MAX_SALT} of [A-Za-z0-9._:-], got {header[:40]!r}"
        )
    return salt


def _priority(header: str) -> int:
    """The router's scheduling priority for this request (it overrides the body's)."""
    try:
        return int(header)
    except ValueError:
        raise InvalidRequest(f"{PRIORITY_HEADER} must be an integer, got {header[:40]!r}") from None


async def _send(resp: web.StreamResponse, body: dict[str, Any]) -> None:
    await resp.write(_event(body))


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def _replay(tokenizer: Any, gen: GenerationRequest) -> tuple[str, FinishEvent | None]:
    """A continuation's resumed tokens through the same incremental detokenizer and stop
    strings as the engine that produced them: the text its client already has, and, when
    the answer had ended within them (its max_tokens, a stop string, a complete grammar:
    the first engine went before it could say so), its finish; None when it goes on."""
    text, seen, hit = IncrementalText(tokenizer, gen.stop), [], False
    for token in gen.resumed:
        delta, stopped = text.add(token)
        seen.append(delta)
        hit = hit or stopped
    done = gen.constraint is not None and gen.constraint.done
    if not (hit or done or gen.max_tokens == 0):
        return "".join(seen), None
    reason: Literal["stop", "length"] = "stop" if hit or done else "length"
    return "".join(seen), FinishEvent(reason, text.flush(), len(gen.prompt), len(gen.resumed))


async def _just(event: Event) -> AsyncIterator[Event]:
    yield event


async def _models(svc: InferenceService) -> web.Response:
    """The served model, once its weights are loaded (503 before: a model listed here
    answers requests, the readiness contract of docs/architecture.md)."""
    serving = svc.ready()
    card = {
        "id": svc.model_name,
        "object": "model",
        "created": svc.created,
        "owned_by": "cognitora",
        "max_model_len": serving.ctx,
    }
    loaded = serving.adapters.listing() if serving.adapters else {}
    cards = [  # as vLLM lists its adapters: the base as root and parent
        {**card, "id": name, "root": svc.model_name, "parent": svc.model_name}
        for name in sorted(loaded)
    ]
    return web.json_response({"object": "list", "data": [card, *cards]})


async def _health(svc: InferenceService) -> web.Response:
    if svc.serving is None:
        return web.json_response({"status": "loading"}, status=503)
    if (failure := svc.serving.engine.failure) is not None:
        return web.json_response({"status": "failed", "reason": failure}, status=503)
    return web.json_response({"status": "ok"})


async def _metrics(svc: InferenceService) -> web.Response:
    return web.Response(
        body=generate_latest(svc.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
