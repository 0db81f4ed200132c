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

Usage: a streaming request that did not ask for usage is sent upstream with
`stream_options.include_usage` set; the usage chunk is read for accounting
and not relayed. Responses carry `x-cognitora-model` (the model that served,
which differs from the one asked for after a fallback) and
`x-cognitora-endpoint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from cgn_core.http import PRIORITY_HEADER, bearer_header
from cgn_router.registry import EndpointState
from cgn_router.settings import DeadlineSettings
from cgn_router.upstream import ConnectFailed, Response, Upstream, UpstreamError

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MAX_ERROR_BODY = 64 << 10


class AttemptFailed(Exception):
    """Nothing reached the client yet: the request may go to another endpoint."""

    def __init__(self, cause: str, message: str, *, timeout: bool = False, breaker: bool = True):
        super().__init__(message)
        self.cause, self.message, self.timeout, self.breaker = cause, message, timeout, breaker


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Attempt:
    """One try of a request: where it goes and what it carries."""

    state: EndpointState
    path: str
    payload: bytes
    stream: bool
    strip_usage: bool  # the client did not ask for the usage chunk: read it, do not relay it
    served_model: str
    uncached_tokens: int  # counted into the endpoint's pending prefill until the first byte
    usage: Usage | None = None
    failed_mid_stream: str = ""  # the cause, when the stream broke after the first byte
    client_gone: bool = False  # the client disconnected mid-stream
    extra_headers: dict[str, str] = field(default_factory=dict)  # e.g. x-cgn-queue-ms
    priority: int | None = None  # sent to the engine as x-cgn-priority


class Proxy:
    def __init__(self, upstream: Upstream, deadlines: DeadlineSettings):
        self.upstream = upstream
        self.deadlines = deadlines

    async def run(
        self, request: web.Request, a: Attempt, started: float, on_first_byte: Callable[[], None]
    ) -> web.StreamResponse:
        """Send `a` upstream and relay the answer to `request`'s client."""
        d = self.deadlines
        now = asyncio.get_running_loop().time()
        total_at = now + d.total_s - (time.monotonic() - started)
        ep = a.state.endpoint
        headers = {"Content-Type": "application/json", **bearer_header(ep.token)}
        rid = request.headers.get("x-request-id")
        if rid and "\r" not in rid and "\n" not in rid:
            headers["x-request-id"] = rid
        if a.priority is not None:
            headers[PRIORITY_HEADER] = str(a.priority)
        post = self.upstream.post(ep.url, a.path, a.payload, headers, d.connect_s)
        if not a.stream:  # one deadline for the whole answer
            late = "answer not complete in time"
            async with _phase(ep.id, total_at, "total_timeout", late):
                with await post as resp:
                    if resp.status != 200:
                        return await self._refused(resp, a)
                    body = await resp.read()
            return self._relay_body(body, resp.content_type, a, on_first_byte)
        first_at = min(total_at, now + d.first_token_s)
        async with _phase(ep.id, first_at, "first_token_timeout", "no answer in time"):
            resp = await post
        with resp:  # an unfinished body closes the connection: the engine stops generating
            if resp.status != 200:
                return await self._refused(resp, a)
            return await self._relay_stream(request, resp, a, first_at, total_at, on_first_byte)

    async def _refused(self, resp: Response, a: Attempt) -> web.Response:
        """A non-200 answer: a client error is relayed, anything else is retried elsewhere."""
        ep = a.state.endpoint
        try:
            body = await resp.read(MAX_ERROR_BODY)
        except UpstreamError:
            body = b""
        if resp.status == 429:
            raise AttemptFailed("busy", f"{ep.id}: engine busy (429)", breaker=False)
        if resp.status >= 500 or resp.status < 400:
            raise AttemptFailed(f"status_{resp.status}", f"{ep.id}: engine answered {resp.status}")
        return web.Response(
            body=body, status=resp.status, headers=self._headers(a, resp.content_type)
        )

    def _relay_body(
        self, body: bytes, content_type: str, a: Attempt, on_first_byte: Callable[[], None]
    ) -> web.Response:
        on_first_byte()
        if b'"usage"' in body:
            with contextlib.suppress(ValueError):
                a.usage = _usage(json.loads(body))
        return web.Response(body=body, status=200, headers=self._headers(a, content_type))

    async def _relay_stream(
        self,
        request: web.Request,
        resp: Response,
        a: Attempt,
        first_at: float,
        total_at: float,
        on_first_byte: Callable[[], None],
    ) -> web.StreamResponse:
        ep = a.state.endpoint
        loop = asyncio.get_running_loop()
        async with _phase(ep.id, first_at, "first_token_timeout", "no first token in time"):
            event = await _next_event(resp)
        if event is None:
            raise AttemptFailed("disconnect", f"{ep.id}: stream ended before the first event")
        out = web.StreamResponse(status=200, headers=self._headers(a, None, sse=True))
        await out.prepare(request)
        on_first_byte()
        idle = self.deadlines.idle_s
        while event is not None:
            if not self._usage_event(event, a):
                try:
                    await out.write(event)
                except ConnectionResetError:  # the client left: closing upstream stops the engine
                    a.client_gone = True
                    return out
            try:
                async with asyncio.timeout_at(min(total_at, loop.time() + idle)):
                    event = await _next_event(resp)
            except TimeoutError:
                cause = "total_timeout" if loop.time() >= total_at else "idle_timeout"
                await self._break(out, a, cause, f"{ep.id}: the stream stalled ({cause})")
                return out
            except UpstreamError as exc:
                msg = f"{ep.id}: the engine disconnected mid-stream ({_describe(exc)})"
                await self._break(out, a, "disconnect_mid_stream", msg)
                return out
        await out.write_eof()
        return out

    def _usage_event(self, event: bytes, a: Attempt) -> bool:
        """Record usage from a usage-only chunk; True when it must not be relayed."""
        if b'"usage"' not in event or not event.startswith(b"data: {"):
            return False
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return False
        if (
            not isinstance(chunk, dict)
            or chunk.get("choices")
            or not isinstance(chunk.get("usage"), dict)
        ):
            return False
        a.usage = _usage(chunk)
        return a.strip_usage

    async def _break(self, out: web.StreamResponse, a: Attempt, cause: str, message: str) -> None:
        a.failed_mid_stream = cause
        body = {
            "error": {"message": message, "type": "upstream_error", "param": None, "code": cause}
        }
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await out.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await out.write_eof()

    def _headers(self, a: Attempt, content_type: str | None, sse: bool = False) -> dict[str, str]:
        headers = dict(SSE_HEADERS) if sse else {"Content-Type": content_type or "application/json"}
        headers["x-cognitora-model"] = a.served_model
        headers["x-cognitora-endpoint"] = a.state.endpoint.id
        headers.update(a.extra_headers)
        return headers


@contextlib.asynccontextmanager
async def _phase(eid: str, deadline: float, timeout_cause: str, late: str) -> AsyncIterator[None]:
    """Bound one upstream step by `deadline`; its failures become `AttemptFailed`."""
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except TimeoutError:
        raise AttemptFailed(timeout_cause, f"{eid}: {late}", timeout=True) from None
    except UpstreamError as exc:
        cause = "connect" if isinstance(exc, ConnectFailed) else "disconnect"
        raise AttemptFailed(cause, f"{eid}: {_describe(exc)}") from None


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


def _usage(body: Any) -> Usage | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0

    def num(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

    return Usage(num(usage.get("prompt_tokens")), num(usage.get("completion_tokens")), num(cached))


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
