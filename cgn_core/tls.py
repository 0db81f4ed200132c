"""TLS material for gRPC channels and servers and for HTTPS listeners, built from TlsSettings.

Mutual TLS between Cognitora's own processes: servers require a client
certificate signed by the cluster CA (cgn_core.pki); a peer that claims a node
id (the `x-cgn-node` header or gRPC metadata) must present a certificate whose
CN is that id, or the call is refused with a message that says so.

Plaintext is a development default only: callers log a warning when
`TlsSettings.enabled` is false (see `warn_if_plaintext`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from cgn_core.errors import ConfigError
from cgn_core.files import read_regular
from cgn_core.settings import TlsSettings

MAX_PEM_BYTES = 1 << 20  # a certificate, key or CA bundle larger than this is not one


def _read(path: object, what: str) -> bytes:
    """A PEM file's bytes; ConfigError unless it is a regular file (a FIFO never hangs us)."""
    try:
        return read_regular(Path(str(path)), MAX_PEM_BYTES)
    except OSError as exc:
        raise ConfigError(f"cannot read TLS {what} {path}: {exc.strerror}") from None


def _regular(*paths: object) -> None:
    """Before OpenSSL opens these by name: each a regular file, or a ConfigError."""
    for path in paths:
        if path is not None:
            _read(path, "file")


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    """Client credentials: trust `ca_file`, present `cert_file`/`key_file` when both are set."""
    if tls.ca_file is None:
        raise ConfigError("TLS requested without a CA file (tls.ca_file)")
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError("tls.cert_file and tls.key_file must be set together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file, "CA file"),
        private_key=_read(tls.key_file, "key file") if tls.key_file else None,
        certificate_chain=_read(tls.cert_file, "certificate file") if tls.cert_file else None,
    )


def channel(address: str, tls: TlsSettings | None, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A (blocking) gRPC channel to one of our services: mutual TLS when `tls` is enabled,
    plaintext otherwise."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.insecure_channel(address, options=options)


def grpc_peer_cn(context: Any) -> str | None:
    """The CN of the verified client certificate of a gRPC call (sync or asyncio servicer
    context); None without one."""
    names = context.auth_context().get("x509_common_name", [])
    return names[0].decode() if names else None


def warn_if_plaintext(log: logging.Logger, what: str, tls: TlsSettings) -> None:
    if not tls.enabled:
        log.warning("%s runs without TLS (plaintext): fine for development only", what)


def _check_pair(tls: TlsSettings) -> None:
    if tls.ca_file is None or tls.cert_file is None or tls.key_file is None:
        raise ConfigError("mutual TLS needs tls.ca_file, tls.cert_file and tls.key_file")


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """gRPC server credentials that require a client certificate signed by `ca_file`."""
    _check_pair(tls)
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file, "key file"), _read(tls.cert_file, "certificate file"))],
        root_certificates=_read(tls.ca_file, "CA file"),
        require_client_auth=True,
    )


def server_ssl_context(tls: TlsSettings, *, client_cert: str = "required") -> ssl.SSLContext:
    """An HTTPS server context; `client_cert` is required, optional (checked per call) or none."""
    if tls.cert_file is None or tls.key_file is None:
        raise ConfigError("HTTPS needs tls.cert_file and tls.key_file")
    _regular(tls.cert_file, tls.key_file, tls.ca_file if client_cert != "none" else None)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
        if tls.ca_file is not None and client_cert != "none":
            ctx.load_verify_locations(str(tls.ca_file))
            ctx.verify_mode = ssl.CERT_REQUIRED if client_cert == "required" else ssl.CERT_OPTIONAL
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS material: {exc}") from None
    return ctx


def client_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """An HTTPS client context trusting `ca_file` and presenting our certificate when set."""
    if tls.ca_file is None:
        raise ConfigError("TLS requested without a CA file (tls.ca_file)")
    _regular(tls.ca_file, tls.cert_file, tls.key_file)
    try:
        ctx = ssl.create_default_context(cafile=str(tls.ca_file))
        if tls.cert_file is not None and tls.key_file is not None:
            ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS material: {exc}") from None
    return ctx


def peer_common_name(peercert: dict[str, Any] | None) -> str | None:
    """The CN of a verified peer certificate as `SSLObject.getpeercert()` returns it."""
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


NODE_HEADER = "x-cgn-node"  # the node id a peer claims (HTTP header / gRPC metadata)


class NodeIdentityInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses a gRPC call whose certificate CN differs from the node id it claims in metadata."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        claimed = dict(details.invocation_metadata or ()).get(NODE_HEADER)
        handler = await continuation(details)
        if claimed is None or handler is None:
            return handler
        return _wrap_with_cn_check(handler, str(claimed))


def _wrap_with_cn_check(handler: grpc.RpcMethodHandler, claimed: str) -> grpc.RpcMethodHandler:
    def check(context: grpc.aio.ServicerContext) -> str | None:
        cn = grpc_peer_cn(context)
        if cn != claimed:
            return f"certificate CN {cn!r} does not match the claimed node id {claimed!r}"
        return None

    if handler.unary_stream is not None:
        inner = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            why = check(context)
            if why:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            async for item in inner(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            why = check(context)
            if why:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    return handler  # streaming-request methods: none in proto/ yet
