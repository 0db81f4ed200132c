"""aiohttp pieces every HTTP edge shares: OpenAI-style errors and JSON bodies."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from cgn_core import safejson
from cgn_core.errors import (
    CognitoraError,
    Forbidden,
    InternalError,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    http_response_parts,
)
from cgn_core.kv.events import KvEventHub
from cgn_core.net import is_loopback

if TYPE_CHECKING:
    from cgn_core.revocation import RevocationList

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The router → engine scheduling priority of a request (its key's band; lower runs sooner).
# cgn-infer queues by it, ahead of the body's `priority`; other engines ignore the header.
PRIORITY_HEADER = "x-cgn-priority"
# The router → engine KV salt of a request (cgn_core/kv/blockhash.py:tenant_salt): its
# tenant's blocks are hashed apart from every other tenant's. Trusted from the router only.
KV_SALT_HEADER = "x-cgn-kv-salt"
# vLLM's body field for the same (its prefix cache is salted per request since 0.9): the
# router sets it for vLLM endpoints, and refuses it from a client.
CACHE_SALT_FIELD = "cache_salt"


def json_error(err: CognitoraError) -> web.Response:
    """`err` as an OpenAI-style JSON response with its status."""
    status, headers, body = http_response_parts(err)
    return web.json_response(body, status=status, headers=headers)


def error_middleware(
    max_body_bytes: int, on_client_error: Callable[[CognitoraError], None] = lambda _: None
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Turn every CognitoraError and aiohttp HTTP error into an OpenAI-style JSON response."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except CognitoraError as err:
            if err.http_status < 500:
                on_client_error(err)
            return json_error(err)
        except web.HTTPRequestEntityTooLarge:
            too_large = PayloadTooLarge(f"request body over {max_body_bytes} bytes")
            on_client_error(too_large)
            return json_error(too_large)
        except web.HTTPException as exc:  # 404/405 from routing
            return json_error(_http_error(exc))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to answer
        except Exception:  # NOTE: the top of a request; the traceback stays in the log
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return json_error(InternalError("internal error; the server log has the details"))

    return middleware


def _http_error(exc: web.HTTPException) -> CognitoraError:
    return _status_error(exc.status, exc.reason)


def _status_error(status: int, message: str) -> CognitoraError:
    err = CognitoraError(message)
    err.http_status = status  # type: ignore[misc]
    err.openai_type = "invalid_request_error" if status < 500 else "server_error"  # type: ignore[misc]
    return err


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole request body, or RequestTimeout when it takes longer than `timeout_s`
    (a client that trickles its body must not hold a handler forever)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None


class _JsonErrorHandler(RequestHandler):
    """aiohttp's protocol handler, answering its own errors (malformed request lines and
    headers, oversized heads) as OpenAI-style JSON instead of text/plain."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once bytes went out
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        text = message if status < 500 and message else phrase
        resp = json_error(_status_error(status, text))
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """`web.AppRunner` for every Cognitora listener: protocol errors as JSON, and a connection
    that sends no complete request head for `idle_timeout_s` closed (aiohttp's keep-alive
    timer also runs from the moment a connection opens, so it bounds slow heads too)."""

    def __init__(self, app: web.Application, *, idle_timeout_s: float, **kwargs: Any):
        super().__init__(app, keepalive_timeout=idle_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # NOTE: only __call__ differs; no state added
        return server


def parse_json(raw: bytes) -> Any:
    """The request body parsed as JSON (cgn_core/safejson.py: bounded depth, no lone
    surrogates); InvalidRequest otherwise."""
    return safejson.loads(raw, "the request body")


def bearer_header(token: str) -> dict[str, str]:
    """`Authorization: Bearer <token>` for a caller holding an engine's secret ({} for none)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_middleware(token: str, open_paths: frozenset[str]) -> Any:
    """Every path but `open_paths` needs `Authorization: Bearer <token>` (401 otherwise).

    Sets `request["authenticated"]` for handlers that trust authenticated callers more
    (cgn-infer honours x-cgn-priority only from them)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        request["authenticated"] = hmac.compare_digest(given, expected)
        if request.path not in open_paths and not request["authenticated"]:
            return json_error(Unauthorized("this engine takes requests from its router only"))
        return await handler(request)

    return check


def loopback_middleware(open_paths: frozenset[str]) -> Any:
    """A plaintext admin listener: management paths answer loopback callers only (403 JSON
    otherwise); give the listener a certificate (admin_tls) to manage it from elsewhere."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in open_paths and not is_loopback(request.remote):
            why = "management over plaintext is answered on loopback only; configure admin_tls"
            return json_error(Forbidden(why))
        return await handler(request)

    return check


def mtls_middleware(open_paths: frozenset[str], revoked: RevocationList | None = None) -> Any:
    """HTTPS admin listeners: every path but `open_paths` needs a verified client certificate,
    not on the deny-list `revoked`, whose CN must equal the node id the caller claims in
    `x-cgn-node` (when it claims one).

    The listener's SSL context verifies certificates optionally (CERT_OPTIONAL), so health
    checks and metric scrapers need none; management calls are refused with 403 without one.
    """
    from cgn_core.tls import NODE_HEADER, peer_common_name

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        if not cert:
            return json_error(
                Forbidden("a client certificate signed by the cluster CA is required")
            )
        cn = peer_common_name(cert)
        if revoked is not None and (node := revoked.revoked(cert)) is not None:
            return json_error(Forbidden(f"certificate of {node!r} (CN {cn!r}) is revoked"))
        claimed = request.headers.get(NODE_HEADER)
        if claimed is not None and claimed != cn:
            why = f"certificate CN {cn!r} does not match the claimed node id {claimed!r}"
            return json_error(Forbidden(why))
        return await handler(request)

    return check


async def serve_sse(hub: KvEventHub, request: web.Request) -> web.StreamResponse:
    """GET handler: the snapshots, then every event, as server-sent events until the
    subscriber falls behind or the hub closes."""
    snapshot, sub = hub.subscribe()
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await resp.prepare(request)
        await resp.write(snapshot)
        while (msg := await sub.queue.get()) is not None:
            await resp.write(msg)
    finally:
        hub.unsubscribe(sub)
    with contextlib.suppress(ConnectionResetError):  # the subscriber already went away
        await resp.write_eof()
    return resp
