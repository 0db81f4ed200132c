"""aiohttp pieces every HTTP edge shares: OpenAI-style errors and JSON bodies."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from cgn_core.errors import (
    CognitoraError,
    Forbidden,
    InvalidRequest,
    PayloadTooLarge,
    http_response_parts,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The router → engine scheduling priority of a request (its key's band; lower runs sooner).
# cgn-infer queues by it, ahead of the body's `priority`; other engines ignore the header.
PRIORITY_HEADER = "x-cgn-priority"


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

    return middleware


def _http_error(exc: web.HTTPException) -> CognitoraError:
    err = CognitoraError(exc.reason)
    err.http_status = exc.status  # type: ignore[misc]
    err.openai_type = "invalid_request_error" if exc.status < 500 else "server_error"  # type: ignore[misc]
    return err


async def read_json(request: web.Request) -> Any:
    """The request body parsed as JSON; InvalidRequest when it is not."""
    return parse_json(await request.read())


def parse_json(raw: bytes) -> Any:
    """`raw` parsed as JSON; InvalidRequest when it is not."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("the request body is not valid JSON") from None


def mtls_middleware(open_paths: frozenset[str]) -> Any:
    """HTTPS admin listeners: every path but `open_paths` needs a verified client certificate,
    whose CN must equal the node id the caller claims in `x-cgn-node` (when it claims one).

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
        claimed = request.headers.get(NODE_HEADER)
        if claimed is not None and claimed != cn:
            why = f"certificate CN {cn!r} does not match the claimed node id {claimed!r}"
            return json_error(Forbidden(why))
        return await handler(request)

    return check
