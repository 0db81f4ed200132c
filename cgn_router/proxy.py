"""The streaming proxy: one attempt of one request against one endpoint.

Until the first byte of a successful answer has reached the client, any
failure (connect error, 5xx, 429, timeout, the engine dying) raises
`AttemptFailed` and the caller may try another endpoint. After that, the
client has a 200 and an open event stream: a failure then ends the stream
with one SSE `error` event (the OpenAI clients raise it) and no `[DONE]`.

Deadlines (`deadlines.*`): connect; first token (request sent → first event
of a stream, or the whole answer of a non-streaming request, bounded by the
total); idle (between two streamed events); total. A client that goes away
closes the upstream connection, which cancels the generation on the engine.
A stream that goes idle past its deadline is evidence that its engine
stalled (stopped, frozen): the requests that still wait for their first byte
from that engine fail at once as `stalled` (`FirstWaits`) and are tried
elsewhere, instead of each waiting out its first-token deadline.

Migration (cgn_core/openai/resume.py): a stream to an engine that can continue
another's answer (`Call.track`) asks it for the token ids it produces and keeps
them (`Progress`); when that stream breaks before its finish chunk (connection
lost, stalled past the idle deadline, an engine error event), the stream is left
open and the attempt returns it (`Relayed.broken`) for the caller to continue on
another engine (`run` with `Call.resume`: the continuation's events go into the
same response) or to end (`end`). A stream that broke after its finish chunk
lacks only `[DONE]`: it is ended as a whole answer.

Usage: a streaming request that did not ask for usage is sent upstream with
`stream_options.include_usage` set; the usage chunk is read for accounting
and not relayed. Responses carry `x-cognitora-model` (the model that served,
which differs from the one asked for after a fallback) and
`x-cognitora-endpoint`.

The proxy owns no routing state: it is given a `Call` (what to send where) and
a `Lease` (told of the first byte), and returns a `Relayed` value saying how
the attempt ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cgn_core.h1 import Reply, Request, StreamReply
from cgn_core.http import CACHE_SALT_FIELD, KV_SALT_HEADER, PRIORITY_HEADER, bearer_header
from cgn_core.kv import transfer as kv_transfer
from cgn_core.openai import resume
from cgn_core.openai.request import LORA_FIELD, LORA_SCALE_FIELD
from cgn_router.settings import DeadlineSettings
from cgn_router.tracked import Progress, Watch, track
from cgn_router.types import Endpoint, Usage
from cgn_router.upstream import ConnectFailed, Response, Upstream, UpstreamError

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MAX_ERROR_BODY = 64 << 10
MAX_EXCHANGE_BODY = 1 << 20  # a prefill leg's answer: one token and its params
# engine answer headers relayed to the client (a decode leg's: how its KV arrived)
PASSED_ON = (kv_transfer.HEADER,)


class AttemptFailed(Exception):
    """Nothing reached the client yet: the request may go to another endpoint."""

    def __init__(self, cause: str, message: str, *, timeout: bool = False, breaker: bool = True):
        super().__init__(message)
        self.cause, self.message, self.timeout, self.breaker = cause, message, timeout, breaker


@dataclass(frozen=True, slots=True)
class Call:
    """One attempt of a request: what goes to which endpoint, and how to answer the client."""

    endpoint: Endpoint
    path: str
    payload: bytes
    stream: bool
    strip_usage: bool  # the client did not ask for the usage chunk: read it, do not relay it
    served_model: str
    total_at: float  # monotonic deadline of the whole request
    response_headers: Mapping[str, str]  # added to the client's response (x-cgn-queue-ms)
    priority: int | None = None  # sent to the engine as x-cgn-priority
    kv_salt: str | None = None  # sent to the engine as x-cgn-kv-salt (in the body: vLLM)
    # the LoRA adapter asked for and its scale: llama.cpp's `lora` id and scale, else the
    # adapter's name as the `model` (the endpoint lists it loaded: the registry chose it)
    adapter: tuple[str, float] | None = None
    request_id: str = ""  # the client's x-request-id, passed on
    track: bool = False  # ask for token ids (resume.IDS_HEADER): the stream may migrate
    resume: Progress | None = None  # a continuation: relay into this stream's response
    trace_headers: Mapping[str, str] | None = None  # traceparent (tracing on)
    # a tracked stream from an engine that names no token ids: keep its events (their text
    # is re-tokenized if it breaks, cgn_core/openai/continuation.py)
    keep_events: bool = False
    # a continuation from another API: each event rewritten as the client's (continuation.py)
    translate: Callable[[bytes], list[bytes]] | None = None


Ending = Literal["ok", "client_error", "client_disconnected", "upstream_error"]


@dataclass(frozen=True, slots=True)
class Relayed:
    """An attempt that answered the client: how it ended and what the engine reported."""

    response: Reply | StreamReply
    ending: Ending
    usage: Usage | None = None
    cause: str = ""  # why the stream broke after the first byte (ending upstream_error)
    broken: Progress | None = None  # a tracked stream that broke, still open: continue or end


class FirstByte(Protocol):
    def first_byte(self, now: float) -> None:
        """The answer's first byte is on its way to the client."""
        ...


class FirstWaits:
    """The attempts waiting for an endpoint's first byte (or, unstreamed, its whole answer),
    each by its deadline's `asyncio.Timeout`, so that a stall seen on one of the endpoint's
    streams ends them all at once (`stalled`)."""

    def __init__(self) -> None:
        self.waiting: dict[str, set[asyncio.Timeout]] = {}
        self.stalled: set[asyncio.Timeout] = set()

    def first(self, eid: str, deadline: float, cause: str, late: str) -> Deadline:
        """A step bounded by `deadline` that `stall(eid)` ends early."""
        return Deadline(eid, deadline, cause, late, self)

    def stall(self, eid: str) -> int:
        """End every wait on `eid` now; how many there were."""
        waiting = self.waiting.get(eid, ())
        now = asyncio.get_running_loop().time()
        for timeout in waiting:
            self.stalled.add(timeout)
            timeout.reschedule(now)
        return len(waiting)


class Deadline:
    """One upstream step bounded by a deadline (a loop time), as `async with`: its failures
    become AttemptFailed (`timeout_cause` past the deadline; `stalled` when its endpoint's
    FirstWaits says so; connect or disconnect for the upstream's errors)."""

    __slots__ = ("cause", "eid", "late", "timeout", "waits")

    def __init__(self, eid: str, deadline: float, cause: str, late: str, waits: FirstWaits):
        self.eid, self.cause, self.late, self.waits = eid, cause, late, waits
        self.timeout = asyncio.timeout_at(deadline)

    async def __aenter__(self) -> None:
        self.waits.waiting.setdefault(self.eid, set()).add(self.timeout)
        await self.timeout.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, exc: Any, tb: Any) -> None:
        eid, waits, timeout = self.eid, self.waits, self.timeout
        try:
            await timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            if timeout in waits.stalled:
                why = f"{eid}: the engine stalled (a stream on it was silent past idle_s)"
                raise AttemptFailed("stalled", why) from None
            raise AttemptFailed(self.cause, f"{eid}: {self.late}", timeout=True) from None
        finally:
            waiting = waits.waiting[eid]
            waiting.discard(timeout)
            if not waiting:
                del waits.waiting[eid]
            waits.stalled.discard(timeout)
        if kind is not None and issubclass(kind, UpstreamError):
            cause = "connect" if issubclass(kind, ConnectFailed) else "disconnect"
            raise AttemptFailed(cause, f"{eid}: {_describe(exc)}") from None


# A tracked stream on a withdrawn endpoint that writes nothing for this long moves (Proxy.
# withdraw): an engine being stopped after its drain may hold its connections silently.
WITHDRAWN_IDLE_S = 2.0

# Engines that take a request's KV salt in its body (`cache_salt`: vLLM since 0.9, SGLang);
# cgn-infer takes the header. llama.cpp, MLX and TensorRT-LLM take none: one cache for all.
BODY_SALT_ENGINES = frozenset({"vllm", "sglang"})
# Engines asked to name a tracked stream's token ids in its chunks (vLLM's
# `return_token_ids`): a break continues from them (cgn_core/openai/continuation.py)
RETURN_IDS_ENGINES = frozenset({"vllm"})
LORA_ID_ENGINES = frozenset({"llamacpp"})  # a request names a loaded adapter by its index
LORA_SCALE_ENGINES = frozenset({"cgn-infer"})  # take `lora_scale` (vLLM and SGLang: none)
RETURN_IDS_FIELD = "return_token_ids"


def with_field(payload: bytes, name: str, value: Any) -> bytes:
    """The JSON body `payload` (the router parsed it: an object) with `name` set to `value`.
    Written before its closing brace, the rest of the bytes as they are: parsing and encoding
    a long prompt's body again cost 2.5 ms per 100k tokens. Where `name` is written in it
    already (as a key, or in a string), it is parsed and encoded whole instead, so that the
    engine reads one key, the router's."""
    end = payload.rstrip()
    if name.encode() in payload or not end.endswith(b"}"):
        body = json.loads(payload)
        body[name] = value
        return json.dumps(body, ensure_ascii=False).encode()
    inner = end[:-1].rstrip()
    comma = b"" if inner.endswith(b"{") else b","
    return b"%s%s%s:%s}" % (inner, comma, json.dumps(name).encode(), json.dumps(value).encode())


def _with_adapter(payload: bytes, ep: Endpoint, adapter: tuple[str, float] | None) -> bytes:
    """The body for LoRA `adapter` (name, scale; None: the base) on `ep`: llama.cpp applies
    one of those it loaded (unapplied, at start) by its index; the other engines serve it
    as a model.

    NOTE: llama.cpp reuses a slot's cached prompt across requests of different adapters
    (ggml-org/llama.cpp#26207, open): the KV of one adapter's prompt answers another's, or
    the base's, wrongly and silently. A llama.cpp replica with adapters loaded gets every
    request without its prompt cache, base ones too: correct, and slower where prompts
    repeat (our own tests saw the base answer garbage after an adapter's request)."""
    body = json.loads(payload)
    if ep.engine in LORA_ID_ENGINES:
        body[LORA_FIELD] = [] if adapter is None else [
            {"id": ep.adapters.index(adapter[0]), "scale": adapter[1]}
        ]  # fmt: skip
        body["cache_prompt"] = False
    elif adapter is not None and ep.engine == "sglang":  # its OpenAI API's adapter field
        body["lora_path"] = adapter[0]
    elif adapter is not None:
        body["model"] = adapter[0]
        if ep.engine in LORA_SCALE_ENGINES and adapter[1] != 1.0:
            body[LORA_SCALE_FIELD] = adapter[1]
    return json.dumps(body, ensure_ascii=False).encode()


def upstream_request(call: Call) -> tuple[dict[str, str], bytes]:
    """The headers and body `call` goes to its endpoint with (the proxy sends them; the
    endpoint picker hands them to the gateway that does): the engine's secret, the
    request's priority, KV salt and adapter in the engine's own fields."""
    ep = call.endpoint
    headers = {"Content-Type": "application/json", **bearer_header(ep.token)}
    if call.request_id:
        headers["x-request-id"] = call.request_id
    if call.priority is not None:
        headers[PRIORITY_HEADER] = str(call.priority)
    payload = call.payload
    if call.kv_salt is not None:
        headers[KV_SALT_HEADER] = call.kv_salt
        if ep.engine in BODY_SALT_ENGINES:
            payload = with_field(payload, CACHE_SALT_FIELD, call.kv_salt)
    if call.adapter is not None or (ep.adapters and ep.engine in LORA_ID_ENGINES):
        payload = _with_adapter(payload, ep, call.adapter)
    if call.track:
        # NOTE: a continuation rewritten from /v1/completions (`translate`) is read from
        # its events, kept: a cgn-infer taking one writes no ids lines to rewrite
        if call.translate is None:
            headers[resume.IDS_HEADER] = "1"
        if ep.engine in RETURN_IDS_ENGINES:
            payload = with_field(payload, RETURN_IDS_FIELD, True)
    if call.trace_headers:
        headers.update(call.trace_headers)
    return headers, payload


class Proxy:
    def __init__(
        self, upstream: Upstream, deadlines: DeadlineSettings, max_response_bytes: int = 64 << 20
    ):
        self.max_response_bytes = max_response_bytes
        self.upstream = upstream
        self.deadlines = deadlines
        self.waits = FirstWaits()
        self.watches: dict[str, set[Watch]] = {}  # endpoint -> its tracked streams (withdraw)

    def _post(self, call: Call) -> Awaitable[Response]:
        headers, payload = upstream_request(call)
        headers["Accept-Encoding"] = "identity"  # the answer is relayed, parsed for usage
        return self.upstream.post(
            call.endpoint.url, call.path, payload, headers, self.deadlines.connect_s
        )

    async def run(self, request: Request, call: Call, lease: FirstByte) -> Relayed:
        """Send `call` upstream and relay the answer to `request`'s client."""
        d = self.deadlines
        now = asyncio.get_running_loop().time()
        total_at = now + call.total_at - time.monotonic()
        ep = call.endpoint
        post = self._post(call)
        if not call.stream:  # one deadline for the whole answer
            late = "answer not complete in time"
            async with self.waits.first(ep.id, total_at, "total_timeout", late):
                with await post as resp:
                    _identity(resp, ep.id)
                    call = _passed_on(call, resp)
                    if resp.status != 200:
                        return await self._refused(resp, call)
                    # NOTE: read to one byte past the cap, never the whole of a declared length
                    body = await resp.read(self.max_response_bytes + 1)
            if len(body) > self.max_response_bytes:
                why = f"{ep.id}: an answer over max_response_bytes ({self.max_response_bytes})"
                raise AttemptFailed("too_large", why)
            lease.first_byte(time.monotonic())
            return self._relay_body(body, resp.content_type, call)
        first_at = min(total_at, now + d.first_token_s)
        async with self.waits.first(ep.id, first_at, "first_token_timeout", "no answer in time"):
            resp = await post
        call = _passed_on(call, resp)
        with resp:  # an unfinished body closes the connection: the engine stops generating
            _identity(resp, ep.id)
            if resp.status != 200:
                return await self._refused(resp, call)
            return await self._relay_stream(request, resp, call, first_at, total_at, lease)

    async def exchange(self, call: Call) -> Any:
        """POST `call` and return its JSON answer, relaying nothing (a prefill leg); the
        whole exchange bounded by `call.total_at`. AttemptFailed on a connect error, a
        timeout, an answer other than 200 or a body that is not a JSON object."""
        ep = call.endpoint
        total_at = asyncio.get_running_loop().time() + call.total_at - time.monotonic()
        async with self.waits.first(
            ep.id, total_at, "total_timeout", "answer not complete in time"
        ):
            with await self._post(call) as resp:
                _identity(resp, ep.id)
                body = await resp.read(MAX_EXCHANGE_BODY)
        if resp.status != 200:
            raise AttemptFailed(f"status_{resp.status}", f"{ep.id}: engine answered {resp.status}")
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise AttemptFailed("bad_answer", f"{ep.id}: the answer is not a JSON object")
        return answer

    async def _refused(self, resp: Response, call: Call) -> Relayed:
        """A non-200 answer: a client error is relayed, anything else is retried elsewhere."""
        eid = call.endpoint.id
        try:
            body = await resp.read(MAX_ERROR_BODY)
        except UpstreamError:
            body = b""
        if resp.status == 429:
            raise AttemptFailed("busy", f"{eid}: engine busy (429)", breaker=False)
        if resp.status >= 500 or resp.status < 400:
            raise AttemptFailed(f"status_{resp.status}", f"{eid}: engine answered {resp.status}")
        headers = _headers(call, resp.content_type)
        return Relayed(Reply(resp.status, headers, body), "client_error")

    def _relay_body(self, body: bytes, content_type: str, call: Call) -> Relayed:
        usage = None
        if b'"usage"' in body:
            with contextlib.suppress(ValueError):
                usage = usage_of(json.loads(body))
        response = Reply(200, _headers(call, content_type), body)
        return Relayed(response, "ok", usage)

    async def _relay_stream(
        self,
        request: Request,
        resp: Response,
        call: Call,
        first_at: float,
        total_at: float,
        lease: FirstByte,
    ) -> Relayed:
        eid = call.endpoint.id
        loop = asyncio.get_running_loop()
        late = "no first token in time"
        async with self.waits.first(eid, first_at, "first_token_timeout", late):
            event = await _next_event(resp)
        if event is None:
            raise AttemptFailed("disconnect", f"{eid}: stream ended before the first event")
        progress = call.resume
        if progress is not None:  # a continuation: the client's stream is already open
            out = progress.out
        else:
            out = request.stream(200, _headers(call, None, sse=True))
            progress = None
            if call.track:
                kept: list[bytes] | None = [] if call.keep_events else None
                progress = Progress(out, engine=call.endpoint.engine, events=kept)
        translate = call.translate
        lease.first_byte(time.monotonic())
        watch = self._watch(eid, progress)
        try:
            idle, usage = self.deadlines.idle_s, None
            pending: bytes | None = event
            while pending is not None:
                batch = []  # the events already here go out in one write (one syscall each)
                failed = ""
                while pending is not None:
                    for event in (pending,) if translate is None else translate(pending):
                        if progress is not None:
                            event, failed = track(progress, event)
                            if failed:
                                break
                        got = usage_chunk(event)
                        usage = got or usage
                        if got is None or not call.strip_usage:
                            batch.append(event)
                    if failed:
                        break
                    pending = await _next_event(resp) if resp.event_buffered() else None
                try:
                    # NOTE: never an empty write: in a chunked body it would end the stream
                    if batch:
                        await out.write(b"".join(batch))
                except ConnectionResetError:  # the client left: closing upstream stops the engine
                    return Relayed(out, "client_disconnected", usage)
                if failed:  # an error event from the engine, in place of the rest of the answer
                    return await self._broken(
                        out, progress, usage, "engine_error", f"{eid}: {failed}"
                    )
                try:
                    quiet = WITHDRAWN_IDLE_S if watch is not None and watch.withdrawn else idle
                    async with asyncio.timeout_at(min(total_at, loop.time() + quiet)) as timeout:
                        if watch is not None:
                            watch.timeout = timeout
                        pending = await _next_event(resp)
                except TimeoutError:
                    cause = "total_timeout" if loop.time() >= total_at else "idle_timeout"
                    if cause == "idle_timeout" and watch is not None and watch.withdrawn:
                        cause = "withdrawn"
                        msg = f"{eid}: its endpoint was withdrawn and the stream went quiet"
                        return await self._broken(out, progress, usage, cause, msg)
                    if cause == "idle_timeout" and (moved := self.waits.stall(eid)):
                        log.warning("%s stalled: %d request(s) waiting on it move", eid, moved)
                    msg = f"{eid}: the stream stalled ({cause})"
                    return await self._broken(out, progress, usage, cause, msg)
                except UpstreamError as exc:
                    msg = f"{eid}: the engine disconnected mid-stream ({_describe(exc)})"
                    return await self._broken(out, progress, usage, "disconnect_mid_stream", msg)
                finally:
                    if watch is not None:
                        watch.timeout = None
            await out.write_eof()
            return Relayed(out, "ok", usage)
        finally:
            self._unwatch(progress)

    def _watch(self, eid: str, progress: Progress | None) -> Watch | None:
        """A tracked stream's watch for this leg, on `eid`: `withdraw` finds it."""
        if progress is None:
            return None
        progress.watch = Watch(eid)
        self.watches.setdefault(eid, set()).add(progress.watch)
        return progress.watch

    def _unwatch(self, progress: Progress | None) -> None:
        """A tracked stream's leg ended: its watch goes."""
        watch = progress.watch if progress is not None else None
        if watch is not None:
            progress.watch = None  # type: ignore[union-attr]
            left = self.watches.get(watch.eid)
            if left is not None:
                left.discard(watch)
                if not left:
                    del self.watches[watch.eid]

    def withdraw(self, eid: str) -> int:
        """`eid`'s endpoint is gone (drained, its engine stopping): its tracked streams move
        once they go quiet for WITHDRAWN_IDLE_S, not `deadlines.idle_s` (an engine told to
        stop may keep its connections open and write nothing); how many it has."""
        watches = self.watches.pop(eid, set())
        now = asyncio.get_running_loop().time()
        for watch in watches:
            watch.withdrawn = True
            if watch.timeout is not None and watch.timeout.when() is not None:
                watch.timeout.reschedule(min(watch.timeout.when() or now, now + WITHDRAWN_IDLE_S))
        return len(watches)

    async def _broken(
        self,
        out: StreamReply,
        progress: Progress | None,
        usage: Usage | None,
        cause: str,
        message: str,
    ) -> Relayed:
        """A stream that broke after its first byte: a tracked one is left open for the
        caller (`Relayed.broken`), one that had sent its finish chunk is whole, and any
        other ends with an error event."""
        if progress is not None and progress.finished:  # only [DONE] (and usage) were left
            with contextlib.suppress(ConnectionError):
                await out.write(b"data: [DONE]\n\n")
                await out.write_eof()
            return Relayed(out, "ok", usage)
        if progress is not None and cause != "total_timeout":
            progress.why = message
            return Relayed(out, "upstream_error", usage, cause, progress)
        await _break(out, cause, message)
        return Relayed(out, "upstream_error", usage, cause)

    async def end(self, relayed: Relayed, why: str) -> Relayed:
        """End a broken stream that will not be continued, saying why, as an untracked one
        would have ended."""
        assert relayed.broken is not None
        message = f"{relayed.broken.why} (not continued: {why})"
        assert isinstance(relayed.response, StreamReply)  # only a stream breaks mid-answer
        await _break(relayed.response, relayed.cause, message)
        return dataclasses.replace(relayed, broken=None)


def usage_chunk(event: bytes) -> Usage | None:
    """The usage of a usage-only chunk (no choices), else None."""
    if b'"usage"' not in event or not event.startswith(b"data: {"):
        return None
    try:
        chunk = json.loads(event[6:])
    except ValueError:
        return None
    if not isinstance(chunk, dict) or chunk.get("choices"):
        return None
    return usage_of(chunk)


async def _break(out: StreamReply, cause: str, message: str) -> None:
    """End a stream that already answered 200 with one SSE error event (and no [DONE])."""
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": cause}}
    with contextlib.suppress(ConnectionError):
        await out.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await out.write_eof()


def _passed_on(call: Call, resp: Response) -> Call:
    """`call` with the engine's answer headers the client should see added (a decode
    leg's `kv_transfer.HEADER`: how its KV arrived)."""
    extra = {h: v for h in PASSED_ON if (v := resp.headers.get(h)) and "\n" not in v}
    if not extra:
        return call
    return dataclasses.replace(call, response_headers={**call.response_headers, **extra})


def _identity(resp: Response, eid: str) -> None:
    """AttemptFailed (tried elsewhere) for an answer in a content coding the router did not
    accept: it could not read its usage or events, and relayed without its
    Content-Encoding (the router relays no engine header but a few) it is garbage."""
    coding = resp.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        why = f"{eid}: answered in {coding[:40]!r} coding, which was not accepted"
        raise AttemptFailed("bad_answer", why)


def _headers(call: Call, content_type: str | None, sse: bool = False) -> dict[str, str]:
    headers = dict(SSE_HEADERS) if sse else {"Content-Type": content_type or "application/json"}
    headers["x-cognitora-model"] = call.served_model
    headers["x-cognitora-endpoint"] = call.endpoint.id
    headers.update(call.response_headers)
    return headers


async def _next_event(resp: Response) -> bytes | None:
    """The next SSE event (its lines and the blank line), or None at the end of the stream."""
    lines: list[bytes] = []
    while True:
        line = await resp.readline()
        if not line:
            return b"".join(lines) + b"\n" if lines else None
        if line in (b"\n", b"\r\n"):
            if lines:
                lines.append(line)
                return b"".join(lines)
            continue
        lines.append(line)


def usage_of(body: Any) -> Usage | None:
    """The usage of an answer's JSON body (or a usage chunk's), each figure bounded: a count
    no answer could have (negative, not an integer, 2^40 or more) reads as 0."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0

    def num(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 else 0

    return Usage(num(usage.get("prompt_tokens")), num(usage.get("completion_tokens")), num(cached))


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
