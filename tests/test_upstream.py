"""The router's upstream client against a loopback server that answers with exact bytes.

The server reads each request (head and Content-Length body) and answers with
what the test scripts for that request: the bytes of an answer, optionally
followed by closing the connection. The router's end-to-end tests (real
engines, streaming, disconnects, deadlines) run through the same client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from cgn_core.etcd.local import free_port
from cgn_router.upstream import ConnectFailed, Disconnected, Upstream, _Conn, origin

Script = Callable[[int], tuple[bytes, bool]]  # request number -> (answer bytes, close after)
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@dataclass
class Server:
    url: str
    requests: list[bytes] = field(default_factory=list)  # each request's head and body
    connections: int = 0


@asynccontextmanager
async def serve(script: Script) -> AsyncIterator[Server]:
    srv = Server("")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        srv.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                srv.requests.append(head + body)
                answer, close = script(len(srv.requests))
                writer.write(answer)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    srv.url = f"http://127.0.0.1:{port}/prefix"
    async with server:
        yield srv


def always(answer: bytes, close: bool = False) -> Script:
    return lambda _: (answer, close)


async def post(up: Upstream, srv: Server, body: bytes = b'{"a":1}') -> bytes:
    with await up.post(srv.url, "/v1/x", body, {"Content-Type": "application/json"}, 2.0) as r:
        assert r.status == 200
        return await r.read()


def run(coro_fn: Callable[[], object]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 10))  # type: ignore[arg-type]


def test_content_length_answers_reuse_one_connection() -> None:
    async def main() -> None:
        async with serve(always(OK)) as srv, Upstream() as up:
            assert [await post(up, srv) for _ in range(3)] == [b"{}"] * 3
            assert srv.connections == 1 and up.idle_count() == 1
            head = srv.requests[0].split(b"\r\n")
            assert head[0] == b"POST /prefix/v1/x HTTP/1.1"
            assert b"Content-Length: 7" in head and srv.requests[0].endswith(b'{"a":1}')
            assert not any(h.lower().startswith(b"accept-encoding") for h in head)

    run(main)


def test_chunked_body_is_read_line_by_line_across_chunk_boundaries() -> None:
    pieces = [b"data: one", b"\n\n", b"data: tw", b"o\n\n"]  # lines split across chunks
    events = b"".join(pieces)
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nT: 1\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks

    async def main() -> None:
        async with serve(always(answer)) as srv, Upstream() as up:
            r = await up.post(srv.url, "/v1/x", b"", {}, 2.0)
            lines = []
            while line := await r.readline():
                lines.append(line)
            assert lines == [b"data: one\n", b"\n", b"data: two\n", b"\n"]
            assert b"".join(lines) == events
            assert up.idle_count() == 1  # read to the end: pooled again
            assert await post(up, srv) == events and srv.connections == 1

    run(main)


def test_interim_answers_are_skipped_and_headers_folded() -> None:
    answer = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nX-A: 1\r\nx-a: 2\r\n"
              b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: 0\r\n\r\n")  # fmt: skip

    async def main() -> None:
        async with serve(always(answer)) as srv, Upstream() as up:
            with await up.post(srv.url, "/", b"", {}, 2.0) as r:
                assert (r.status, r.headers["x-a"], r.content_type) == (201, "1, 2", "text/plain")
                assert await r.read() == b""
            assert up.idle_count() == 1

    run(main)


def test_close_delimited_bodies_and_connection_close_are_not_pooled() -> None:
    async def main() -> None:
        old = b"HTTP/1.0 200 OK\r\n\r\nuntil the end"
        async with serve(always(old, close=True)) as srv, Upstream() as up:
            assert await post(up, srv) == b"until the end"
            assert await post(up, srv) == b"until the end"
            assert srv.connections == 2 and up.idle_count() == 0
        closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
        async with serve(always(closing, close=True)) as srv, Upstream() as up:
            assert await post(up, srv) == b"{}" and up.idle_count() == 0

    run(main)


def test_a_stale_pooled_connection_is_replaced_without_the_caller_noticing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        # the server answers and then closes every connection, keep-alive headers or not
        async with serve(always(OK, close=True)) as srv, Upstream() as up:
            assert await post(up, srv) == b"{}"
            await asyncio.sleep(0.05)  # the close reaches us while the connection is idle
            assert await post(up, srv) == b"{}"  # seen at once: not reused
            assert srv.connections == 2 and len(srv.requests) == 2
            # the race: the close lands after the connection was taken from the pool
            await asyncio.sleep(0.05)
            monkeypatch.setattr(_Conn, "usable", lambda *_: True)
            assert await post(up, srv) == b"{}"  # sent again on a fresh connection
            assert srv.connections == 3 and len(srv.requests) == 3

    run(main)


def test_a_fresh_connection_closed_without_an_answer_is_an_error_not_a_loop() -> None:
    async def main() -> None:
        async with serve(always(b"", close=True)) as srv, Upstream() as up:
            with pytest.raises(Disconnected, match="closed the connection"):
                await up.post(srv.url, "/", b"", {}, 2.0)
            assert srv.connections == 1

    run(main)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x answer"),
        (b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n", "without a colon"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Len", "head was cut off"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (70 << 10) + b"\r\n\r\n", "head over"),
    ],
)
def test_malformed_answers_are_disconnects(answer: bytes, match: str) -> None:
    async def main() -> None:
        async with serve(always(answer, close=True)) as srv, Upstream() as up:
            with pytest.raises(Disconnected, match=match):
                await up.post(srv.url, "/", b"", {}, 2.0)
            assert up.idle_count() == 0

    run(main)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd",
    ],
)
def test_a_body_cut_short_or_badly_framed_is_a_disconnect(answer: bytes) -> None:
    async def main() -> None:
        async with serve(always(answer, close=True)) as srv, Upstream() as up:
            r = await up.post(srv.url, "/", b"", {}, 2.0)
            with pytest.raises(Disconnected):
                await r.read()
            assert up.idle_count() == 0

    run(main)


def test_closing_an_unread_answer_drops_the_connection() -> None:
    async def main() -> None:
        async with serve(always(OK)) as srv, Upstream() as up:
            with await up.post(srv.url, "/", b"", {}, 2.0) as r:
                assert r.status == 200  # body never read
            assert up.idle_count() == 0
            assert await post(up, srv) == b"{}" and srv.connections == 2

    run(main)


def test_a_bounded_read_returns_the_start_and_drops_the_connection() -> None:
    big = b"HTTP/1.1 500 Oops\r\nContent-Length: 100000\r\n\r\n" + b"e" * 100000

    async def main() -> None:
        async with serve(always(big)) as srv, Upstream() as up:
            with await up.post(srv.url, "/", b"", {}, 2.0) as r:
                assert r.status == 500 and await r.read(10) == b"e" * 10
            assert up.idle_count() == 0

    run(main)


def test_idle_connections_expire_and_the_pool_is_bounded() -> None:
    async def main() -> None:
        async with serve(always(OK)) as srv, Upstream(keepalive_s=0.0) as up:
            await post(up, srv)
            await post(up, srv)
            assert srv.connections == 2  # the idle one was too old to reuse
        async with serve(always(OK)) as srv, Upstream(max_idle=2) as up:
            await asyncio.gather(*(post(up, srv) for _ in range(5)))
            assert srv.connections == 5 and up.idle_count() == 2

    run(main)


def test_connection_refused_and_bad_headers_fail_before_sending() -> None:
    async def main() -> None:
        async with Upstream() as up:
            with pytest.raises(ConnectFailed, match="cannot connect"):
                await up.post(f"http://127.0.0.1:{free_port()}", "/", b"", {}, 2.0)
            with pytest.raises(ConnectFailed, match="bad endpoint URL"):
                await up.post("http://h:99999", "/", b"", {}, 2.0)
            with pytest.raises(ValueError, match="line break"):
                await up.post("http://127.0.0.1:1", "/", b"", {"x": "a\r\nb: c"}, 2.0)

    run(main)


def test_origins_parse_hosts_ports_and_prefixes() -> None:
    assert origin("http://[::1]:8000/v").authority == "[::1]:8000"
    assert origin("https://engine/").port == 443 and origin("https://engine/").prefix == ""
    assert origin("http://h:1/a/b/").prefix == "/a/b"
    with pytest.raises(ValueError, match="not an http"):
        origin("unix:///tmp/sock")
