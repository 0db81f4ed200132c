"""Cognitora's error hierarchy and its single mapping to HTTP / OpenAI-style JSON.

Every error is either *retryable* (the same request may succeed later or
elsewhere: overload, an unreachable peer, a timeout) or *permanent* (the
request or the configuration is wrong and retrying cannot help). Code below
the edges raises these; only the edges (an HTTP handler, a CLI command, a
gRPC servicer) turn them into a status code, a JSON body or an exit code.

    CognitoraError
    ├── PermanentError                  retryable = False
    │   ├── InvalidRequest        400   invalid_request_error
    │   ├── Unauthorized          401   authentication_error
    │   ├── Forbidden             403   permission_error
    │   ├── NotFound              404   not_found_error
    │   ├── MethodNotAllowed      405   invalid_request_error
    │   ├── RequestTimeout        408   invalid_request_error
    │   ├── PayloadTooLarge       413   invalid_request_error
    │   ├── HeadTooLarge          431   invalid_request_error
    │   ├── ConfigError           500   server_error (a daemon's own config)
    │   └── InternalError         500   server_error
    └── RetryableError                  retryable = True
        ├── RateLimited           429   rate_limit_error (carries Retry-After)
        ├── Overloaded            503   server_overloaded
        ├── Unavailable           503   service_unavailable (a peer is down)
        │   └── EtcdUnavailable
        └── UpstreamTimeout       504   timeout
"""

from __future__ import annotations

from typing import Any, ClassVar


class CognitoraError(Exception):
    """Base of every error Cognitora raises on purpose."""

    retryable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class PermanentError(CognitoraError):
    """Retrying the same request cannot succeed."""


class RetryableError(CognitoraError):
    """The same request may succeed later or on another replica."""

    retryable = True


class InvalidRequest(PermanentError):
    http_status = 400
    openai_type = "invalid_request_error"


class Unauthorized(PermanentError):
    http_status = 401
    openai_type = "authentication_error"


class Forbidden(PermanentError):
    http_status = 403
    openai_type = "permission_error"


class NotFound(PermanentError):
    http_status = 404
    openai_type = "not_found_error"


class MethodNotAllowed(PermanentError):
    http_status = 405
    openai_type = "invalid_request_error"


class PayloadTooLarge(PermanentError):
    http_status = 413
    openai_type = "invalid_request_error"


class HeadTooLarge(PermanentError):
    """The request line and headers are over the listener's bound."""

    http_status = 431
    openai_type = "invalid_request_error"


class RequestTimeout(PermanentError):
    """The client did not send its request body in time."""

    http_status = 408
    openai_type = "invalid_request_error"


class ConfigError(PermanentError):
    """A daemon's or a CLI's own configuration is wrong (not the client's request)."""


class InternalError(PermanentError):
    """A bug: something that should not happen did."""


class RateLimited(RetryableError):
    http_status = 429
    openai_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class Overloaded(RetryableError):
    http_status = 503
    openai_type = "server_overloaded"


class Unavailable(RetryableError):
    """A peer this component needs (an engine, etcd, a KV daemon) cannot be reached;
    `retry_after_s` (a Retry-After header) when the caller knows when to come back."""

    http_status = 503
    openai_type = "service_unavailable"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message, code=code, param=param)
        self.retry_after_s = retry_after_s


class EtcdUnavailable(Unavailable):
    """etcd did not answer within the deadline, or refused the connection."""


class BadGateway(RetryableError):
    """An upstream engine failed or answered with an error of its own."""

    http_status = 502
    openai_type = "upstream_error"


class UpstreamTimeout(RetryableError):
    http_status = 504
    openai_type = "timeout"


def openai_error_body(err: CognitoraError) -> dict[str, Any]:
    """The OpenAI-style JSON body for `err`: {"error": {message, type, param, code}}."""
    return {
        "error": {
            "message": err.message,
            "type": err.openai_type,
            "param": err.param,
            "code": err.code,
        }
    }


def http_response_parts(err: CognitoraError) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Status, extra headers and JSON body for `err`, the one mapping every HTTP edge uses."""
    headers: dict[str, str] = {}
    if isinstance(err, RateLimited | Unavailable) and err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
    return err.http_status, headers, openai_error_body(err)
