"""cgn_core/h1.py, the router's HTTP/1.1 server, against raw sockets on loopback.

Each test starts a server in-process with a handler that says what it saw,
talks to it with exact bytes (asyncio streams), and reads the exact answer:
framing, keep-alive and pipelining, the errors a hostile client gets (400,
408, 413, 431, all JSON), a client leaving mid-handler, streams, and shutdown.
The router's end-to-end tests (tests/test_router.py, tests/test_edge_fuzz.py)
run every OpenAI request through the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgn_core.errors import NotFound
from cgn_core.h1 import FRAMING_BYTES, LINGER_S, Reply, Request, Server, StreamReply

LIMIT = 1000  # max_body_bytes


class App:
    """A handler: /echo answers the body; /stream streams 3 chunks; /slow waits for a release;
    /boom raises; /missing raises NotFound; /auth answers 401 without reading the body."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.arrived = asyncio.Event()  # a request reached the handler

    async def __call__(self, req: Request) -> Reply | StreamReply:
        self.seen.append((req.method, req.path, dict(req.headers)))
        self.arrived.set()
        if req.path in ("/echo", "/patient"):  # /patient waits long for its body
            body = await req.read(timeout_s=0.5 if req.path == "/echo" else 30)
            return Reply(200, {"Content-Type": "text/plain", "X-Seen": req.path}, body)
        if req.path == "/stream":
            out = req.stream(200, {"Content-Type": "text/event-stream"})
            for i in range(3):
                await out.write(b"data: %d\n\n" % i)
            await out.write_eof()
            return out
        if req.path == "/drip":  # streams until the client leaves
            out = req.stream(200, {"Content-Type": "text/event-stream"})
            try:
                for i in range(1000):
                    await out.write(b"data: %d\n\n" % i)
                    await asyncio.sleep(0.02)
            except (asyncio.CancelledError, ConnectionError):
                self.cancelled.set()
                raise
            return out
        if req.path == "/slow":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return Reply(200, {}, b"done")
        if req.path == "/boom":
            raise RuntimeError("a bug")
        if req.path == "/auth":
            return Reply.json({"error": "no key"}, 401)
        raise NotFound(f"no such path: {req.path}")


@asynccontextmanager
async def running(
    idle_timeout_s: float = 5.0, max_head_bytes: int = 4096
) -> AsyncIterator[tuple[App, Server, int]]:
    app = App()
    server = Server(
        app, max_body_bytes=LIMIT, idle_timeout_s=idle_timeout_s, max_head_bytes=max_head_bytes
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await server.start(sock)
    try:
        yield app, server, sock.getsockname()[1]
    finally:
        app.release.set()
        await server.shutdown(1.0)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lower-cased), body (Content-Length or chunked, decoded)."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def post(path: str, body: bytes, *extra: str, length: int | None = None) -> bytes:
    """A POST of `body`, saying it is `length` bytes (its own length by default)."""
    size = len(body) if length is None else length
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {size}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def closed(reader: asyncio.StreamReader, within_s: float = 5.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except ConnectionError:
        return True


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async with running() as (app, _, port):
        reader, writer = await connect(port)
        writer.write(post("/echo", b"one") + post("/echo?q=1", b"two") + post("/echo", b"3"))
        answers = [await read_answer(reader) for _ in range(3)]
        assert [a[2] for a in answers] == [b"one", b"two", b"3"]
        assert all(a[0] == 200 and "connection" not in a[1] for a in answers)
        assert [p for _, p, _ in app.seen] == ["/echo"] * 3  # the query is not the path
        assert app.seen[0][2]["content-length"] == "3"  # headers under lower-cased names
        writer.close()


async def test_a_chunked_body_and_expect_continue() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        assert (await read_answer(reader))[2] == b"abcde"
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        assert (await read_answer(reader))[2] == b"ok"
        writer.close()


async def test_http_1_0_and_connection_close_end_the_connection() -> None:
    async with running() as (_, _, port):
        for extra in (b"GET /missing HTTP/1.0\r\n\r\n", post("/echo", b"x", "Connection: close")):
            reader, writer = await connect(port)
            writer.write(extra)
            _, headers, _ = await read_answer(reader)
            assert headers["connection"] == "close" and await closed(reader)
            writer.close()


async def test_a_streamed_answer_is_chunked_and_the_connection_is_reused() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)
        writer.write(post("/stream", b""))
        status, headers, body = await read_answer(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.write(post("/echo", b"after"))
        assert (await read_answer(reader))[2] == b"after"
        writer.close()


async def test_a_stream_to_an_http_1_0_client_is_not_chunked_and_ends_with_the_connection() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)
        writer.write(b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 5)  # to the close
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding" not in head and b"Connection: close" in head
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.close()


async def test_each_pipelined_request_is_framed_by_its_own_http_version() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)  # the 1.0 head is parsed before the stream starts
        writer.write(post("/stream", b"") + b"GET /missing HTTP/1.0\r\n\r\n")
        _, headers, body = await read_answer(reader)
        assert headers["transfer-encoding"] == "chunked" and body.startswith(b"data: 0")
        status, headers, _ = await read_answer(reader)
        assert status == 404 and headers["connection"] == "close"
        writer.close()


async def test_handler_errors_are_json_and_the_connection_lives_on() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)
        writer.write(post("/missing", b"") + post("/boom", b""))
        status, _, body = await read_answer(reader)
        assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
        status, _, body = await read_answer(reader)
        assert status == 500 and "a bug" not in body.decode()  # the traceback stays in the log
        assert json.loads(body)["error"]["type"] == "server_error"
        writer.write(post("/echo", b"still"))
        assert (await read_answer(reader))[2] == b"still"
        writer.close()


async def hostile(port: int, data: bytes) -> tuple[int, dict[str, Any], bool]:
    """Send `data`; (status, JSON body, closed after)."""
    reader, writer = await connect(port)
    writer.write(data)
    status, _, body = await read_answer(reader)
    gone = await closed(reader, LINGER_S + 3)
    writer.close()
    return status, json.loads(body), gone


async def test_hostile_heads_get_json_errors_and_a_close() -> None:
    async with running() as (_, _, port):
        status, doc, gone = await hostile(port, b"NOT HTTP AT ALL\r\n\r\n")
        assert status == 400 and "malformed" in doc["error"]["message"] and gone
        huge = b"GET /echo HTTP/1.1\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n"
        status, doc, gone = await hostile(port, huge)
        assert status == 431 and doc["error"]["type"] == "invalid_request_error" and gone
        # an upgrade is not made: the request is answered as a plain one, then the connection
        # closes (what follows it would be the other protocol's bytes)
        reader, writer = await connect(port)
        writer.write(b"GET /echo HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == "close" and await closed(reader)
        writer.close()


async def test_an_oversized_body_is_413_even_while_the_client_still_sends() -> None:
    async with running() as (_, _, port):
        # declared too large: refused at once; the client is still writing its megabyte
        reader, writer = await connect(port)
        writer.write(post("/echo", b"x" * (1 << 20)))
        status, _, body = await read_answer(reader)  # a reset here would lose the answer
        assert status == 413 and "over 1000 bytes" in json.loads(body)["error"]["message"]
        assert await closed(reader, LINGER_S + 3)
        writer.close()
        # chunked, no length said: refused once the bytes pass the bound
        chunk = b"%x\r\n%s\r\n" % (600, b"y" * 600)
        data = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2
        status, _, gone = await hostile(port, data)
        assert status == 413 and gone


async def test_a_trickled_body_is_408_and_an_unread_body_closes_after_the_answer() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)
        writer.write(post("/echo", b"abc", length=10))
        status, _, body = await read_answer(reader)  # the handler waits 0.5 s for it
        assert status == 408 and "did not arrive" in json.loads(body)["error"]["message"]
        assert await closed(reader, LINGER_S + 3)
        writer.close()
        # answered before its body was read (a 401): the rest cannot be told from a next head
        reader, writer = await connect(port)
        writer.write(post("/auth", b"abc", length=10))
        assert (await read_answer(reader))[0] == 401 and await closed(reader, LINGER_S + 3)
        writer.close()


async def test_idle_and_slow_head_connections_are_closed() -> None:
    async with running(idle_timeout_s=0.3) as (_, server, port):
        idle_reader, idle = await connect(port)
        slow_reader, slow = await connect(port)
        slow.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        assert await closed(idle_reader, 3) and await closed(slow_reader, 3)
        reader, writer = await connect(port)  # a served connection is idle after its answer
        writer.write(post("/echo", b"x"))
        await read_answer(reader)
        assert await closed(reader, 3)
        assert not server.connections
        for w in (idle, slow, writer):
            w.close()


async def in_slow(app: App, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose request is in the /slow handler."""
    reader, writer = await connect(port)
    writer.write(post("/slow", b""))
    await asyncio.wait_for(app.arrived.wait(), 5)
    return reader, writer


async def test_a_client_that_leaves_cancels_its_handler() -> None:
    """A reset cancels at once; a close (FIN, which a half-close also sends) is seen by the
    stream's next writes, so a streamed answer's engine stops within a chunk or two."""
    async with running() as (app, _, port):
        _, writer = await in_slow(app, port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.close()  # SO_LINGER 0: a reset
        await asyncio.wait_for(app.cancelled.wait(), 5)
        app.cancelled.clear()
        reader, writer = await connect(port)
        writer.write(post("/drip", b""))
        await reader.readuntil(b"data: 1")
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)


async def test_shutdown_answers_what_is_in_flight_then_refuses() -> None:
    async with running() as (app, server, port):
        idle_reader, idle = await connect(port)
        reader, writer = await in_slow(app, port)
        stopping = asyncio.create_task(server.shutdown(5.0))
        assert await closed(idle_reader, 3)  # idle connections go at once
        app.release.set()
        status, headers, body = await read_answer(reader)
        assert status == 200 and body == b"done" and headers["connection"] == "close"
        await asyncio.wait_for(stopping, 5)
        try:
            await connect(port)
            refused = False
        except ConnectionError:
            refused = True
        assert refused
        for w in (writer, idle):
            w.close()


async def test_shutdown_cancels_handlers_past_its_timeout() -> None:
    async with running() as (app, server, port):
        _, writer = await in_slow(app, port)
        await asyncio.wait_for(server.shutdown(0.2), 5)
        assert app.cancelled.is_set()
        writer.close()


async def trickle(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, piece: bytes) -> int:
    """Write `piece` until the server answers or closes (at most 1,000 times): the bytes sent."""
    sent = 0
    for _ in range(1000):
        if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]
            break
        try:
            writer.write(piece)
            await writer.drain()
        except ConnectionError:
            break
        sent += len(piece)
        await asyncio.sleep(0.002)
    return sent


async def test_a_header_value_that_never_ends_is_431_by_its_bytes_not_its_parse() -> None:
    """httptools holds a header's value until it ends: the bytes count as they arrive, so an
    endless value is refused at the head limit (not after the idle sweep), and the server's
    memory stays bounded meanwhile."""
    import tracemalloc

    tracemalloc.start()
    try:
        async with running(idle_timeout_s=60) as (_, _, port):
            before = tracemalloc.get_traced_memory()[0]
            reader, writer = await connect(port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Big: ")
            sent = await trickle(writer, reader, b"a" * 512)
            status, _, body = await read_answer(reader)
            grew = tracemalloc.get_traced_memory()[1] - before
            assert status == 431 and "request head over 4096 bytes" in body.decode()
            assert sent < 4096 + 4 * 512  # refused within a few reads of the limit
            assert grew < 1 << 20
            writer.close()
            # a trailer that never ends is bounded as the body's bytes: refused, not held
            reader, writer = await connect(port)
            writer.write(b"POST /patient HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked")
            writer.write(b"\r\n\r\n1\r\na\r\n0\r\nX-Trailer: ")
            sent = await trickle(writer, reader, b"b" * 4096)
            assert sent <= LIMIT + FRAMING_BYTES + 2 * 4096
            assert (await read_answer(reader))[0] in (413, 431)
            writer.close()
    finally:
        tracemalloc.stop()


async def test_a_malformed_chunked_body_is_400_at_once() -> None:
    """RFC 9112 6.3: a body that cannot be framed is a 400 and a close; the handler waiting
    for it gets the error at once, not its body timeout (30 s for /patient)."""
    bad = [
        b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\nabc",  # overflows 64 bits
        b"Transfer-Encoding: xchunked\r\n\r\nabc",
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc",
    ]
    async with running() as (_, _, port):
        for tail in bad:
            started = asyncio.get_running_loop().time()
            status, doc, gone = await hostile(port, b"POST /patient HTTP/1.1\r\nHost: x\r\n" + tail)
            assert status == 400 and "malformed" in doc["error"]["message"] and gone, tail
            assert asyncio.get_running_loop().time() - started < LINGER_S + 3


async def test_a_client_that_half_closes_after_its_request_gets_the_answer() -> None:
    async with running() as (_, _, port):
        reader, writer = await connect(port)
        writer.write(post("/echo", b"whole") + post("/echo", b"second"))
        writer.write_eof()
        answers = [await read_answer(reader) for _ in range(2)]
        assert [a[2] for a in answers] == [b"whole", b"second"] and await closed(reader)
        writer.close()


# ---- a grammar of heads and chunked bodies (hypothesis) ----

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=12)
VALUE = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")),  # CR, LF, NUL, high bytes
    st.integers(1, 9000).map(lambda n: "v" * n),  # past the head limit
)
HEADER = st.one_of(
    st.tuples(TOKEN, VALUE),
    st.tuples(
        st.sampled_from(["Content-Length", "content-length"]),
        st.one_of(
            st.integers(-5, 5000).map(str), st.just("1" * 30), st.just("3, 4"), st.just("0x10")
        ),
    ),
    st.tuples(
        st.just("Transfer-Encoding"),
        st.sampled_from(
            [
                "chunked",
                "xchunked",
                "gzip, chunked",
                "chunked, gzip",
                "identity",
                "chunked, chunked",
            ]
        ),
    ),
    st.tuples(st.just("Expect"), st.just("100-continue")),
    st.tuples(st.just("Connection"), st.sampled_from(["close", "keep-alive", "upgrade"])),
)
CHUNK = st.one_of(
    st.binary(max_size=700).map(lambda b: b"%x\r\n%s\r\n" % (len(b), b)),
    st.sampled_from([b"FFFFFFFFFFFFFFFFFFFFFF\r\n", b"-1\r\n", b"zz\r\n", b"5;ext=1\r\nabcde\r\n"]),
    st.binary(max_size=20),  # junk
)
REQUEST = st.builds(
    lambda method, path, version, headers, chunks, end, cut: (
        b"%s %s %s\r\n" % (method, path, version)
        + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        + b"\r\n"
        + b"".join(chunks)
        + end,
        cut,
    ),
    st.sampled_from([b"POST", b"GET", b"PUT", b"P\x00ST", b""]),
    st.sampled_from([b"/echo", b"/patient", b"/stream", b"/missing", b"*", b"/" + b"p" * 5000]),
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"HTTP/1.1x"]),
    st.lists(HEADER, max_size=6),
    st.lists(CHUNK, max_size=4),
    st.sampled_from([b"", b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n", b"0\r\n" + b"X: " + b"t" * 6000]),
    st.integers(1, 64),  # written in pieces of 37 times this many bytes
)


async def _one_hostile_exchange(data: bytes, piece: int) -> None:
    """(The memory bound is the trickle test's: what llhttp holds is a budget plus a read.)"""
    async with running(idle_timeout_s=0.5) as (_, _, port):
        reader, writer = await connect(port)
        for at in range(0, len(data), piece):
            if reader.at_eof():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(data[at : at + piece])
        if b" /patient " in data.split(b"\r\n", 1)[0]:
            # /patient waits 30 s for a body that is slow to come, by design; a client that
            # has said all it will (half-closed) gets its answer or the close at once
            with contextlib.suppress(ConnectionError, OSError):
                writer.write_eof()
        # an answer, or the close, within the bound: the body timeouts are 0.5 s (30 s for
        # /patient, half-closed above) and idle is 0.5 s
        try:
            got = await asyncio.wait_for(reader.read(1 << 16), 0.5 + LINGER_S + 2)
        except ConnectionError:
            got = b""
        assert got == b"" or got.startswith(b"HTTP/1.1 "), got[:80]
        writer.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(REQUEST)
def test_any_head_or_chunked_body_is_answered_or_closed_within_a_bound(
    request: tuple[bytes, int],
) -> None:
    data, piece = request
    asyncio.run(asyncio.wait_for(_one_hostile_exchange(data, piece * 37), 10))
