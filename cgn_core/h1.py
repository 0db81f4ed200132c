"""A protocol-level HTTP/1.1 server (llhttp, through httptools) for the router's OpenAI surface.

Why not aiohttp's web server, which the router used before: its request and
response objects, middlewares and stream writer cost about 50 µs of CPU per
request here against under 15 µs for this server on the same parser work
(bench/results/router_vs_smg.md has the router's figures before and after).
The admin listeners and the engines keep aiohttp: they are not the hot path.

What it does, and only that: one handler per request, the requests of one
connection in order (pipelined ones wait their turn, with reading paused past
`PIPELINE` of them); bodies framed by Content-Length or chunked (llhttp
decodes both); answers whole (`Reply`, with Content-Length) or streamed
(`StreamReply`, chunked); keep-alive as HTTP/1.x says; `Expect: 100-continue`
answered when the handler first reads the body. No upgrades, no compression.

Hardening: a request head over `max_head_bytes` is a 431; a malformed one a
400 (JSON, like every error here), and the connection closes; a body over
`max_body_bytes` is a 413 as soon as its declared length or its bytes say so;
a body not whole within the handler's timeout is its 408 (`Request.read`); a
body that turns out malformed (a chunk size that overflows, a coding other
than chunked) is a 400 at once, to the handler that waits for it; a
connection that sends no complete head for `idle_timeout_s` (from its
opening or its last answer) is closed; a client that leaves cancels its
handler (so the proxy closes its upstream request and the engine stops
generating); one that half-closes after a whole request gets its answer.

NOTE: the budgets count the bytes as they arrive, not only as llhttp hands them
over: httptools keeps a header's value (and a trailer's) in its own buffer
until the value ends, so a head that never ends would grow there unseen. Every
read that falls wholly within one head counts against `max_head_bytes`, and
every read within one body (its chunk framing and trailers included) against
`max_body_bytes` plus `FRAMING_BYTES`; a read that crosses into a new head is
counted by llhttp's callbacks alone, so what a parser holds is bounded by a
budget plus one read. Every CognitoraError a handler raises is its
OpenAI-style JSON answer; anything else is a 500 and a log line with the
traceback; an error after a stream started closes the connection.

Shutdown (`Server.shutdown`): stop accepting, close idle connections, let
handlers in flight finish within the drain timeout, then cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from socket import socket
from ssl import SSLContext
from typing import Any

import httptools

from cgn_core.errors import (
    CognitoraError,
    HeadTooLarge,
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    http_response_parts,
)
from cgn_core.h1_answers import Reply as Reply  # re-exported: h1 is the one entry point
from cgn_core.h1_answers import StreamReply as StreamReply

log = logging.getLogger(__name__)
PIPELINE = 8  # pipelined requests held per connection before reading pauses
# After an answer given before its request's body was whole (a 413, a 401), what the client
# still sends is read and dropped for this long before the connection closes: closing with
# unread bytes would reset it, and the client could lose the answer (lingering close).
LINGER_S = 2.0
# What a chunked body may add to its data in chunk-size lines and trailers before the
# connection is refused as too large (1-byte chunks take 6 bytes each: a client that
# sends those is refused at a sixth of the body limit).
FRAMING_BYTES = 1 << 20


class Headers(dict[str, str]):
    """A request's headers under lower-cased names (repeated ones joined with ", ");
    `get` and `[]` take any case."""

    __slots__ = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class Request:
    """One request: its head at once, its body through `read`."""

    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_continue",
        "_error",
        "_size",
        "_too_large",
        "_waiter",
        "chunked",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        target: str,
        headers: Headers,
        *,
        keep_alive: bool,
        http10: bool,
    ):
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.headers = headers
        self.keep_alive = keep_alive
        self.chunked = not http10  # HTTP/1.0 knows no chunked coding
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        length = headers.get("content-length")
        declared = int(length) if length and length.isdigit() else -1
        self._complete = False
        self._too_large = conn.server.max_body_bytes < declared
        self._waiter: asyncio.Future[None] | None = None
        self._error: CognitoraError | None = None  # the body turned out malformed
        self._continue = headers.get("expect", "").lower() == "100-continue"

    @property
    def remote(self) -> str | None:
        """The client's address (None when the transport does not say)."""
        peer = self._conn.transport.get_extra_info("peername") if self._conn.transport else None
        return peer[0] if isinstance(peer, tuple) else None

    async def read(self, timeout_s: float) -> bytes:
        """The whole body: PayloadTooLarge past the server's `max_body_bytes`, RequestTimeout
        when it is not whole within `timeout_s` (a client that trickles its body must not
        hold a handler forever), InvalidRequest when it cannot be parsed,
        ConnectionResetError when the client left."""
        limit = self._conn.server.max_body_bytes
        if not self._complete and not self._too_large and self._error is None:
            if self._continue:
                self._continue = False
                self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            except TimeoutError:
                self.keep_alive = False  # the rest of the body may still come: not a next head
                why = f"the request body did not arrive within {timeout_s:g} s"
                raise RequestTimeout(why) from None
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        if self._too_large:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        return b"".join(self._chunks)

    def stream(self, status: int, headers: dict[str, str]) -> StreamReply:
        """Start a streamed answer: its head goes out now. Chunked; to an HTTP/1.0 client
        (which knows no chunks) the bytes as they are, ended by closing the connection."""
        if not self.chunked:
            self.keep_alive = False
        reply = StreamReply(self, status, headers, self.chunked)
        self._conn.write(reply.head(self.keep_alive))
        return reply

    # ---- fed by the connection ----

    def _body(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self._conn.server.max_body_bytes:
            self._overflow()
        elif not self._too_large:
            self._chunks.append(chunk)

    def _overflow(self) -> None:
        self._too_large = True
        self._chunks.clear()
        self._wake()

    def _fail(self, err: CognitoraError) -> None:
        self._error = err
        self._wake()

    def _done(self) -> None:
        self._complete = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _lost(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionResetError("the client left"))


Handler = Callable[[Request], Awaitable[Reply | StreamReply]]


class Server:
    """Serves `handler` on sockets given to `start`; see the module's docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        idle_timeout_s: float,
        max_head_bytes: int = 64 << 10,
    ):
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.max_head_bytes = max_head_bytes
        self.connections: set[_Connection] = set()
        self.closing = False
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, sock: socket, ssl: SSLContext | None = None) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Connection(self), sock=sock, ssl=ssl)
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self._sweep_every(), self._sweep)

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting; answer what is in flight within `timeout_s`, then cancel it."""
        self.closing = True
        for server in self._servers:
            server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.active is None:
                conn.close()
        # NOTE: with `closing` set, every connection closes after its answer in flight, so
        # no handler starts after these
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.close()
        for server in self._servers:
            await server.wait_closed()

    def _sweep_every(self) -> float:
        return max(0.05, min(1.0, self.idle_timeout_s / 4))

    def _sweep(self) -> None:
        """Close connections idle (no complete head since opening or the last answer)
        longer than `idle_timeout_s`."""
        now = time.monotonic()
        for conn in list(self.connections):
            if conn.idle_since is not None and now - conn.idle_since > self.idle_timeout_s:
                conn.close()
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_every(), self._sweep)


class _Connection(asyncio.Protocol):
    """One client connection: llhttp's callbacks build requests; one handler task at a time."""

    def __init__(self, server: Server):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.active: Request | None = None  # the request whose handler runs
        self.task: asyncio.Task[None] | None = None
        self.pending: deque[Request] = deque()  # pipelined behind it
        self.parsing: Request | None = None  # the request whose body is arriving
        self.idle_since: float | None = time.monotonic()
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._target = b""
        self._headers = Headers()
        self._head_bytes = 0  # of the head being parsed, as llhttp's callbacks hand it over
        self._in_head = True  # what arrives now belongs to a head (or to the gap before one)
        self._begun = 0  # heads begun: a read that saw one begin is not counted whole
        self._received = 0  # bytes of the current head, or body, counted read by read
        self._reading_paused = False
        self._refused = False  # the stream could not be parsed: no more requests from it
        self._eof = False  # the client half-closed: answer what it sent, then close

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP (or TLS) transport
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        for req in (self.active, self.parsing, *self.pending):
            if req is not None:
                req._lost()
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its handler stops (and its upstream call)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client left"))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: dropped
        begun, in_head = self._begun, self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(InvalidRequest("protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            self._refuse(InvalidRequest(f"malformed HTTP request: {exc}"))
        if not self._refused and begun == self._begun and in_head == self._in_head:
            self._count_received(len(data))  # the whole read was one head's, or one body's

    def eof_received(self) -> bool:
        """The client half-closed: a request already whole is still answered (then the
        connection closes); one whose body never came whole is lost."""
        self._eof = True
        if self.parsing is not None:
            self.parsing._lost()
        return self.active is not None and self.active._complete

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ---- llhttp's callbacks ----

    def on_message_begin(self) -> None:
        self._target = b""
        self._headers = Headers()
        self._head_bytes = 0
        self._begun += 1
        self._received = 0

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._head_grew(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_grew(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        seen = self._headers.get(key)
        dict.__setitem__(self._headers, key, text if seen is None else f"{seen}, {text}")

    def on_headers_complete(self) -> None:
        self._in_head, self._received = False, 0
        if self._refused:
            return
        method = self.parser.get_method().decode("ascii", "replace")
        req = Request(
            self,
            method,
            self._target.decode("latin-1"),
            self._headers,
            keep_alive=self.parser.should_keep_alive() and not self.server.closing,
            http10=self.parser.get_http_version() == "1.0",  # NOTE: this head's, not a later one's
        )
        self.parsing = req
        if self.active is None:
            self._start(req)
        else:
            self.pending.append(req)
            if len(self.pending) >= PIPELINE:
                self._pause_reading()

    def on_body(self, body: bytes) -> None:
        req = self.parsing
        if req is not None and not self._refused:
            req._body(body)
            if req._too_large:
                self._pause_reading()  # its answer is a 413 and a close: read no more

    def on_message_complete(self) -> None:
        self._in_head = True
        req, self.parsing = self.parsing, None
        if req is not None:
            req._done()

    # ---- requests and answers ----

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client left")
        self.transport.write(data)

    async def drained(self) -> None:
        if self.write_paused:
            if self._drain is None:
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _start(self, req: Request) -> None:
        self.active = req
        self.idle_since = None
        self.task = asyncio.get_running_loop().create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        reply: Reply | StreamReply
        try:
            reply = await self.server.handler(req)
        except CognitoraError as err:
            reply = _error_reply(err)
        except (asyncio.CancelledError, ConnectionError):
            self.close()
            return
        except Exception:  # NOTE: the top of a request; the traceback stays in the log
            log.exception("unexpected error serving %s %s", req.method, req.path)
            reply = _error_reply(InternalError("internal error; the server log has the details"))
        # NOTE: an answer given before the body was whole (a 401, a 413) ends the connection:
        # what is left of the body cannot be told from the next request's head
        keep = req.keep_alive and req._complete and not self.server.closing
        try:
            if isinstance(reply, Reply):
                self.write(reply.encode(keep))
            elif not reply._ended:  # the handler failed mid-stream: the client must see a cut
                keep = False
        except ConnectionError:
            keep = False
        self._finished(keep)

    def _finished(self, keep: bool) -> None:
        req, self.active, self.task = self.active, None, None
        if self._eof and not (self.pending and self.pending[0]._complete):
            self.close()  # half-closed: nothing more can come
            return
        if not keep:
            if self._refused or (req is not None and not req._complete):
                self._linger()
            else:
                self.close()
            return
        if self.pending:
            self._start(self.pending.popleft())
        else:
            self.idle_since = time.monotonic()
        if self._reading_paused and len(self.pending) < PIPELINE and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _linger(self) -> None:
        """Close after `LINGER_S`, dropping what arrives meanwhile (see LINGER_S)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._refused = True
        if transport.can_write_eof():
            transport.write_eof()  # the answer is whole: the client may read it and leave
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _head_grew(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.server.max_head_bytes:
            self._refuse(HeadTooLarge(f"request head over {self.server.max_head_bytes} bytes"))

    def _count_received(self, n: int) -> None:
        """A read wholly within the current head or body: refused once over its budget."""
        self._received += n
        if self._in_head:
            if self._received > self.server.max_head_bytes:
                self._refuse(HeadTooLarge(f"request head over {self.server.max_head_bytes} bytes"))
        elif self._received > self.server.max_body_bytes + FRAMING_BYTES:
            req = self.parsing
            if req is not None:
                req._overflow()  # its handler answers 413, and the connection closes
            self._refused = True
            self._pause_reading()

    def _refuse(self, err: CognitoraError) -> None:
        """Answer a request that could not be parsed, then close (nothing after it can be
        trusted to start where a request starts)."""
        if self._refused:
            return
        self._refused = True  # NOTE: from here on, what arrives is dropped
        self._pause_reading()
        self.pending.clear()
        if self.active is not None:  # its answer goes out first, then the connection closes
            self.active.keep_alive = False
            if self.parsing is self.active:  # its handler waits for this body: 400 at once
                self.active._fail(err)
            return
        with contextlib.suppress(ConnectionError):
            self.write(_error_reply(err).encode(keep_alive=False))
        self._linger()


def _error_reply(err: CognitoraError) -> Reply:
    status, headers, body = http_response_parts(err)
    return Reply.json(body, status, headers)
