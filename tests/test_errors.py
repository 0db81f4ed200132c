"""The error hierarchy and its single HTTP / OpenAI mapping."""

from __future__ import annotations

import pytest

from cgn_core import errors as e


@pytest.mark.parametrize(
    ("err", "status", "kind", "retryable"),
    [
        (e.InvalidRequest("bad"), 400, "invalid_request_error", False),
        (e.Unauthorized("who"), 401, "authentication_error", False),
        (e.Forbidden("no"), 403, "permission_error", False),
        (e.NotFound("none"), 404, "not_found_error", False),
        (e.PayloadTooLarge("big"), 413, "invalid_request_error", False),
        (e.ConfigError("cfg"), 500, "server_error", False),
        (e.RateLimited("slow", retry_after_s=2.4), 429, "rate_limit_error", True),
        (e.Overloaded("busy"), 503, "server_overloaded", True),
        (e.EtcdUnavailable("down"), 503, "service_unavailable", True),
        (e.UpstreamTimeout("late"), 504, "timeout", True),
    ],
)
def test_mapping(err: e.CognitoraError, status: int, kind: str, retryable: bool) -> None:
    got_status, headers, body = e.http_response_parts(err)
    assert got_status == status
    assert body == {"error": {"message": err.message, "type": kind, "param": None, "code": None}}
    assert err.retryable is retryable
    assert isinstance(err, e.RetryableError if retryable else e.PermanentError)
    assert ("Retry-After" in headers) is isinstance(err, e.RateLimited)


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert e.http_response_parts(e.RateLimited("x", retry_after_s=0.2))[1] == {"Retry-After": "1"}
    assert e.http_response_parts(e.RateLimited("x", retry_after_s=2.6))[1] == {"Retry-After": "3"}
    # a 503 says when to come back where the caller knows (a pool starting from zero)
    assert e.http_response_parts(e.Unavailable("x", retry_after_s=30))[:2] == (
        503,
        {"Retry-After": "30"},
    )


def test_code_and_param_carried() -> None:
    err = e.InvalidRequest(
        "max_tokens too large", code="context_length_exceeded", param="max_tokens"
    )
    body = e.openai_error_body(err)["error"]
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("peer", "path", "status"),
    [("127.0.0.1", "/replicas", 200), ("::1", "/replicas", 200), ("10.1.2.3", "/replicas", 403),
     ("10.1.2.3", "/healthz", 200)],
)  # fmt: skip
async def test_a_plaintext_admin_listener_manages_from_loopback_only(
    peer: str, path: str, status: int
) -> None:
    from unittest import mock

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from cgn_core.http import loopback_middleware

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 40000) if name == "peername" else default
    )
    request = make_mocked_request("GET", path, transport=transport)
    check = loopback_middleware(frozenset({"/healthz"}))

    async def handler(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    resp = await check(request, handler)
    assert resp.status == status
