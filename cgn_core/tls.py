"""TLS material for gRPC channels and servers, built from TlsSettings.

Plaintext is a development default only: callers log a warning when
`TlsSettings.enabled` is false (see `warn_if_plaintext`).
"""

from __future__ import annotations

import logging

import grpc

from cgn_core.errors import ConfigError
from cgn_core.settings import TlsSettings


def _read(path: object, what: str) -> bytes:
    try:
        with open(str(path), "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS {what} {path}: {exc.strerror}") from None


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


def warn_if_plaintext(log: logging.Logger, what: str, tls: TlsSettings) -> None:
    if not tls.enabled:
        log.warning("%s runs without TLS (plaintext): fine for development only", what)
