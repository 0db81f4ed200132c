"""The answers of cgn_core/h1.py's server: whole (`Reply`, Content-Length framed) or streamed
(`StreamReply`, chunked), and the status line and headers they start with."""

from __future__ import annotations

import json
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cgn_core.h1 import Request

_PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus}


class Reply:
    """A whole answer: status, headers and body (Content-Length framed)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    @classmethod
    def json(cls, value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        out = {"Content-Type": "application/json", **(headers or {})}
        return cls(status, out, json.dumps(value).encode())

    def encode(self, keep_alive: bool) -> bytes:
        framing = b"Content-Length: %d\r\n" % len(self.body)
        return _head(self.status, self.headers, framing, keep_alive) + self.body


class StreamReply:
    """A streamed answer, chunked; `write` waits while the client's socket is full and raises
    ConnectionResetError once the client left."""

    __slots__ = ("_chunked", "_ended", "_request", "headers", "status")

    def __init__(
        self, request: Request, status: int, headers: dict[str, str], chunked: bool = True
    ):
        self.status = status
        self.headers = headers
        self._request = request
        self._chunked = chunked
        self._ended = False

    def head(self, keep_alive: bool) -> bytes:
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        return _head(self.status, self.headers, framing, keep_alive)

    async def write(self, data: bytes) -> None:
        if not data:  # an empty chunk would end the body
            return
        conn = self._request._conn
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if conn.write_paused:
            await conn.drained()

    async def write_eof(self) -> None:
        if not self._ended:
            self._ended = True
            if self._chunked:  # NOTE: unchunked, the connection's close ends the body
                self._request._conn.write(b"0\r\n\r\n")


def _head(status: int, headers: dict[str, str], framing: bytes, keep_alive: bool) -> bytes:
    """An answer's status line and headers, its body's `framing` header among them."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES.get(status, b"Unknown"))]
    lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
    lines += (framing, _DATE.line(), b"\r\n" if keep_alive else b"Connection: close\r\n\r\n")
    return b"".join(lines)


class _Date:
    """The Date header, formatted once a second."""

    def __init__(self) -> None:
        self._at = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._at:
            self._at = now
            self._line = f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
        return self._line


_DATE = _Date()
