"""The router's upstream client: HTTP/1.1 POSTs to engines over pooled keep-alive connections.

Why not aiohttp's ClientSession, which the router used before: it was the
largest single item in a profile of the router at full load, and it costs
4.1× the CPU per request of this client (3.5× reading a stream;
bench/upstream_client.py, results in bench/results/upstream_client.md).

What it does, and only that: one request per connection at a time; bodies
framed by Content-Length, chunked transfer coding, or the connection closing;
interim 1xx answers skipped; no redirects, cookies, proxies or compression
(no Accept-Encoding is sent, so the engine's bytes are relayed as they are).
A connection goes back to the pool only once its answer was read to the end
on a keep-alive HTTP/1.1 exchange; any failure or early close drops it, which
is also how the proxy cancels a generation: the engine sees its client leave.

Failures are `ConnectFailed` (nothing was sent) or `Disconnected` (the engine
closed, reset, or answered with something that is not HTTP/1.x). A request on
a reused connection that fails before any answer byte is sent once more on a
fresh connection: the engine most likely closed the idle connection as we
picked it. Tunables: `connect_s` per call, `keepalive_s` (idle connections
older than this are not reused), `max_idle` per origin.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

HEAD_LIMIT = 64 << 10  # the largest answer head (status line and headers) accepted
MAX_LINE = 16 << 20  # the longest body line `readline` buffers (an SSE event line)
READ_SIZE = 64 << 10


class UpstreamError(Exception):
    """The engine could not be reached or broke the exchange."""


class ConnectFailed(UpstreamError):
    """No connection: nothing was sent."""


class Disconnected(UpstreamError):
    """The connection closed or reset, or the answer was not HTTP/1.x."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int
    prefix: str  # the URL's path, prepended to every request path

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@functools.lru_cache(maxsize=1024)
def origin(url: str) -> Origin:
    """Parse an endpoint URL (`http://host:port[/prefix]`); ValueError when it is not one."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Origin(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (
            not self.writer.is_closing()
            and not self.reader.at_eof()
            and now - self.idle_since < keepalive_s
        )

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """A pool of keep-alive connections per origin; `post` sends one request."""

    def __init__(
        self, *, keepalive_s: float = 30.0, max_idle: int = 256, tls: ssl.SSLContext | None = None
    ):
        """`tls`: the context for https origins (the cluster CA, and the router's client
        certificate for engines that require one); default: the system's trust store."""
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._idle: dict[Origin, list[_Conn]] = {}
        self._tls: ssl.SSLContext | None = tls

    async def post(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str], connect_s: float
    ) -> Response:
        """POST `body` to `url` + `path`; returns once the answer's head has arrived.

        The caller reads the body and must `close()` the response (a `with` block
        does), which returns the connection to the pool or drops it.
        """
        try:
            o = origin(url)
        except ValueError as exc:
            raise ConnectFailed(f"bad endpoint URL: {exc}") from None
        head = _request_head(o, path, len(body), headers)
        while True:
            conn = self._take(o)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(o, connect_s)
            try:
                try:
                    conn.writer.write(head + body if len(body) < READ_SIZE else head)
                    if len(body) >= READ_SIZE:
                        conn.writer.write(body)
                    await conn.writer.drain()
                except ConnectionError as exc:
                    raise _NothingReceived(_describe(exc)) from None
                return await _read_head(self, o, conn)
            except _NothingReceived as exc:
                conn.close()
                if not reused:
                    raise Disconnected(f"{o.authority}: {exc}") from None
            except BaseException:
                conn.close()
                raise

    async def __aenter__(self) -> Upstream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection (those in use close with their responses)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def idle_count(self) -> int:
        return sum(len(c) for c in self._idle.values())

    def _take(self, o: Origin) -> _Conn | None:
        conns = self._idle.get(o)
        now = time.monotonic()
        while conns:
            conn = conns.pop()  # the most recently used: the likeliest to be alive
            if conn.usable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    def _release(self, o: Origin, conn: _Conn) -> None:
        conns = self._idle.setdefault(o, [])
        if len(conns) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conns.append(conn)

    async def _connect(self, o: Origin, connect_s: float) -> _Conn:
        tls = None
        if o.scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_s):
                reader, writer = await asyncio.open_connection(
                    o.host, o.port, ssl=tls, limit=HEAD_LIMIT
                )
        except TimeoutError:
            raise ConnectFailed(f"{o.authority}: no connection within {connect_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"{o.authority}: cannot connect ({_describe(exc)})") from None
        return _Conn(reader, writer)


class Response:
    """An answer whose head has been read; the body is read through `read` or `readline`."""

    __slots__ = (
        "_buf",
        "_conn",
        "_eof",
        "_keep",
        "_left",
        "_mode",
        "_origin",
        "_pool",
        "headers",
        "status",
    )

    def __init__(
        self,
        pool: Upstream,
        o: Origin,
        conn: _Conn,
        status: int,
        headers: dict[str, str],
        mode: str,
        length: int,
        keep: bool,
    ):
        self.status = status
        self.headers = headers  # names in lower case; repeated headers joined with ", "
        self._pool, self._origin = pool, o
        self._conn: _Conn | None = conn  # None once pooled again or dropped
        self._mode = mode  # "length", "chunked" or "close"
        self._left = length  # body bytes left to read ("length" only)
        self._buf = bytearray()
        self._eof = False
        self._keep = keep
        if mode == "length" and length == 0:
            self._finish()

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body, or its first `limit` bytes (the connection is then dropped)."""
        if self._mode == "length" and not self._buf and not self._eof and limit is None:
            data = await self._io(self._conn_or_raise().reader.readexactly(self._left))
            self._left = 0
            self._finish()
            return data
        while not self._eof and (limit is None or len(self._buf) < limit):
            await self._fill()
        end = len(self._buf) if limit is None else min(limit, len(self._buf))
        data = bytes(self._buf[:end])
        del self._buf[:end]
        return data

    async def readline(self) -> bytes:
        """The next body line with its `\\n`; the unterminated rest at the end; b"" after it."""
        start = 0
        while True:
            i = self._buf.find(b"\n", start)
            if i >= 0:
                line = bytes(self._buf[: i + 1])
                del self._buf[: i + 1]
                return line
            if self._eof:
                line = bytes(self._buf)
                self._buf.clear()
                return line
            if len(self._buf) > MAX_LINE:
                self.close()
                raise Disconnected(f"{self._origin.authority}: a body line over {MAX_LINE} bytes")
            start = len(self._buf)
            await self._fill()

    def event_buffered(self) -> bool:
        """A whole SSE event (lines and the blank line) is read already: no I/O to get it."""
        return b"\n\n" in self._buf or b"\n\r\n" in self._buf

    def close(self) -> None:
        """Drop the connection unless the body was read to its end (then it is pooled already)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _fill(self) -> None:
        reader = self._conn_or_raise().reader
        if self._mode == "length":
            data = await self._io(reader.read(min(self._left, READ_SIZE)))
            if not data:
                raise self._broken("the engine closed the connection mid-body")
            self._left -= len(data)
            self._buf += data
            if self._left == 0:
                self._finish()
        elif self._mode == "chunked":
            size_line = await self._io(reader.readuntil(b"\r\n"))
            try:
                size = int(size_line.partition(b";")[0].strip(), 16)
            except ValueError:
                raise self._broken(f"a bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while await self._io(reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailer fields: not used
                self._finish()
                return
            chunk = await self._io(reader.readexactly(size + 2))
            if not chunk.endswith(b"\r\n"):
                raise self._broken("a chunk without its CRLF")
            self._buf += memoryview(chunk)[:-2]
        else:
            data = await self._io(reader.read(READ_SIZE))
            if data:
                self._buf += data
            else:
                self._keep = False
                self._finish()

    async def _io(self, op: Awaitable[bytes]) -> bytes:
        try:
            return await op
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            raise self._broken(_describe(exc)) from None
        except BaseException:
            self.close()
            raise

    def _finish(self) -> None:
        self._eof = True
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._keep:
                self._pool._release(self._origin, conn)
            else:
                conn.close()

    def _conn_or_raise(self) -> _Conn:
        if self._conn is None:
            raise Disconnected(f"{self._origin.authority}: the response was closed")
        return self._conn

    def _broken(self, why: str) -> Disconnected:
        self.close()
        return Disconnected(f"{self._origin.authority}: {why}")


class _NothingReceived(Exception):
    """The connection failed before any byte of an answer: safe to send again, fresh."""


def _request_head(o: Origin, path: str, length: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"POST {o.prefix}{path} HTTP/1.1", f"Host: {o.authority}", f"Content-Length: {length}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} holds a line break")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_head(pool: Upstream, o: Origin, conn: _Conn) -> Response:
    """Read the status line and headers (skipping 1xx answers) and decide the body's framing."""
    received = False
    try:
        while True:
            try:
                raw = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial and not received:
                    raise _NothingReceived("the engine closed the connection") from None
                raise Disconnected(f"{o.authority}: the answer's head was cut off") from None
            received = True
            status, keep, headers = _parse_head(raw)
            if not 100 <= status < 200:
                break
    except ConnectionError as exc:
        if not received:
            raise _NothingReceived(_describe(exc)) from None
        raise Disconnected(f"{o.authority}: {_describe(exc)}") from None
    except asyncio.LimitOverrunError:
        raise Disconnected(f"{o.authority}: an answer head over {HEAD_LIMIT} bytes") from None
    except ValueError as exc:
        raise Disconnected(f"{o.authority}: not an HTTP/1.x answer ({exc})") from None
    keep = keep and "close" not in headers.get("connection", "").lower()
    if status in (204, 304):
        return Response(pool, o, conn, status, headers, "length", 0, keep)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Response(pool, o, conn, status, headers, "chunked", 0, keep)
    if (length := headers.get("content-length")) is not None:
        if not length.isdigit():
            raise Disconnected(f"{o.authority}: a bad Content-Length {length[:40]!r}")
        return Response(pool, o, conn, status, headers, "length", int(length), keep)
    return Response(pool, o, conn, status, headers, "close", 0, False)


def _parse_head(raw: bytes) -> tuple[int, bool, dict[str, str]]:
    """(status, HTTP/1.1 keep-alive by default, headers) from a head ending in a blank line."""
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ValueError(repr(lines[0][:60]))
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"a header line without a colon: {line[:60]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return int(code), version == "HTTP/1.1", headers


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the engine closed the connection mid-answer"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
