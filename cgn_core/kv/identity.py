"""Who may use a node's KV store, and the key its SSD blocks are sealed with.

One random 32-byte node secret, in a file only its owner can read (the agent
creates `<state_dir>/kvcached.secret`; a store run as a unit names it in
`secret_file`), and three values derived from it, each for one holder:

    node secret ──HMAC "client"──▶ client token   engines: Put, Get, Lookup, Stats
                ├─HMAC "admin"───▶ admin token    operators: Evict, Clear (and all of the above)
                └─HMAC "seal"────▶ seal key       the store only: keyed BLAKE3 of every SSD block

Engines hold the client token and nothing else, so an engine cannot evict
another's blocks, and no process without the token can write, read or probe
the store. The seal key never leaves the store: a block file written or
swapped on disk by anyone else fails its tag and is never served. A token
travels as `authorization: Bearer <token>` gRPC metadata (on loopback, or
inside mutual TLS). The derivation is pure; reading and creating the file are
the thin I/O below it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cgn_core.errors import ConfigError
from cgn_core.files import open_regular

SECRET_BYTES = 32
# 32 random bytes hold fewer than 8 distinct values with odds below 1e-40: a secret that
# does was not drawn at random
MIN_DISTINCT_BYTES = 8
AUTH_HEADER = "authorization"


@dataclass(frozen=True, slots=True)
class StoreKeys:
    client_token: str
    admin_token: str
    seal_key: bytes  # 32 bytes: BLAKE3's key for the SSD tier's block tags

    @classmethod
    def derive(cls, secret: bytes) -> StoreKeys:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a node secret is {SECRET_BYTES} bytes, got {len(secret)}")

        def mac(label: bytes) -> bytes:
            return hmac.new(secret, b"cgn-kvcached " + label, hashlib.sha256).digest()

        return cls(mac(b"client").hex(), mac(b"admin").hex(), mac(b"seal"))


def bearer(token: str) -> tuple[str, str]:
    """The gRPC metadata pair that carries `token`."""
    return (AUTH_HEADER, f"Bearer {token}")


def presented(metadata: object) -> str:
    """The token a call's metadata carries ("" when none)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


def same(token: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(token.encode(), expected.encode())


# ---- the secret file ----------------------------------------------------------------------


def read_secret(path: Path) -> bytes:
    """The node secret in `path` (64 hex digits). ConfigError unless it is a regular file
    owned by this user that no one else can read or write; links are not followed."""
    try:
        fd, st = open_regular(path, follow_links=False)
    except OSError as exc:
        raise ConfigError(f"secret_file {path}: {exc.strerror}") from None
    try:
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"secret_file {path}: must be owned by this user with mode 0600 "
                f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
            )
        raw = os.read(fd, 4 * SECRET_BYTES)
    finally:
        os.close(fd)
    try:
        secret = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ConfigError(f"secret_file {path}: expected {2 * SECRET_BYTES} hex digits")
    if len(set(secret)) < MIN_DISTINCT_BYTES:  # all zeros, a repeated byte: not a secret
        raise ConfigError(
            f"secret_file {path}: not a random secret ({len(set(secret))} distinct bytes); "
            "delete it and the agent (or cgn-ctl up) makes one"
        )
    return secret


def ensure_secret(path: Path) -> bytes:
    """The node secret in `path`, created (mode 0600, never half-written) when absent."""
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(SECRET_BYTES).hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # NOTE: never replaces a secret another process just made
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return read_secret(path)
