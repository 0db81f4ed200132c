"""Joining a machine to a cluster (#65): the first machine's join service, and the joiner's side.

The service runs where the CA's key is (the first machine's `cgn-ctl`), over HTTPS with a
certificate from that CA:

    GET  /v1/join/ca   the CA certificate (PEM): what a joiner checks against its pinned hash
    POST /v1/join      {"token": "<id>.<secret>", "node": "gpu-02", "csr": "<PEM>"}
                       -> {"node": ..., "cert": "<PEM>", "ca": "<PEM>", "etcd": [endpoints]}

A request is signed (cgn_core/pki.py:sign_request: a node certificate only, for that node
id and its IPs) only when its token spends a use, in one etcd transaction with the record
of the join at `/cognitora/joins/<node>` (the token's id, the certificate's serial), and
only if neither that record nor `/cognitora/nodes/<node>` exists: a node id already taken
is refused and nothing is written, the token included. Then the node gets its etcd user
and role (`cgn-node-<node>`: its own keys only, cgn_core/rbac.py). Refusals are JSON with a
status: 400 malformed, 403 a token or a request refused, 409 a node id taken, 413 too big,
503 the user could not be made (the token is spent: `cgn-ctl pki rbac --node` finishes it).

The joiner (`join`) fetches the CA without trusting the connection, checks its key hash
against the one it was given (`--ca-hash`, as kubeadm's discovery hash: a machine in the
middle shows another CA and is refused before the token is sent), then sends its request
over a connection that trusts only that CA. Its key is made on the joining machine and
never leaves it.

`cgn-ctl up --listen ADDR` runs this service; `cgn-ctl up --join ADDR:PORT` is the joiner.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from typing import Any

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from cgn_core import keys, pki
from cgn_core.errors import CognitoraError, PermanentError
from cgn_core.etcd import EtcdClient, Op
from cgn_core.etcd.auth import apply_plan
from cgn_core.jointokens import NODE_ID, Taken, TokenError, consume, token_id
from cgn_core.rbac import Plan, node_role

log = logging.getLogger(__name__)

MAX_BODY = 64 << 10
TIMEOUT_S = 10.0


class JoinError(PermanentError):
    """A join the service refused or the joiner could not complete; the message says why."""


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def build_join_app(
    client: EtcdClient, ca: pki.Pair, etcd: tuple[str, ...], root: str = keys.ROOT
) -> web.Application:
    """The join service over `client` (etcd's root: tokens, joins, nodes and users under
    `root`) and the CA that signs; a joiner is told to reach etcd at `etcd`."""
    ca_pem = ca.cert.public_bytes(serialization.Encoding.PEM).decode()

    async def get_ca(_: web.Request) -> web.Response:
        return web.Response(text=ca_pem, content_type="application/x-pem-file")

    async def post_join(request: web.Request) -> web.Response:
        if (request.content_length or 0) > MAX_BODY:
            return _refuse(413, f"a join request is at most {MAX_BODY} bytes")
        body = await request.content.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            return _refuse(413, f"a join request is at most {MAX_BODY} bytes")
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return _refuse(400, "the body must be JSON: {token, node, csr}")
        values = [doc.get(k) for k in ("token", "node", "csr")] if isinstance(doc, dict) else []
        if len(values) != 3 or not all(isinstance(v, str) and v for v in values):
            return _refuse(400, "'token', 'node' and 'csr' are required strings")
        token, node, csr = (str(v) for v in values)
        if not NODE_ID.match(node):
            return _refuse(400, "'node' must be 1-63 of [A-Za-z0-9.-], starting alphanumeric")
        try:
            tid = token_id(token)
            cert = pki.sign_request(ca, csr.encode(), node)  # NOTE: before any write
        except (TokenError, pki.PkiError) as exc:
            return _refuse(400 if isinstance(exc, TokenError) else 403, exc.message)
        serial = format(cert.serial_number, "x")
        joined = {"node": node, "token": tid, "serial": serial, "at": time.time()}
        where = (root + keys.JOINS.removeprefix(keys.ROOT) + node,
                 root + keys.NODES.removeprefix(keys.ROOT) + node)  # fmt: skip
        try:
            await consume(
                client,
                token,
                prefix=root + keys.TOKENS.removeprefix(keys.ROOT),
                absent=where,
                then=[Op.put_json(where[0], joined)],
            )
        except Taken:
            return _refuse(409, f"node id {node!r} is taken: join under another id")
        except TokenError as exc:
            return _refuse(403, exc.message)
        try:
            role = f"cgn-node-{node}"
            await apply_plan(client, Plan({role: node_role(node)}, {node: (role,)}), enable=False)
        except CognitoraError as exc:
            log.warning("node %s joined, but its etcd user was not made: %s", node, exc)
            return _refuse(503, f"node {node} joined, but its etcd user was not made ({exc})")
        cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
        return web.json_response({"node": node, "cert": cert_pem, "ca": ca_pem, "etcd": etcd})

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_get("/v1/join/ca", get_ca)
    app.router.add_post("/v1/join", post_join)
    return app


async def fetch_ca(base_url: str, ca_hash: str) -> x509.Certificate:
    """The CA the service at `base_url` shows, if its key hash is `ca_hash`; JoinError if it
    is another (a machine in the middle, or the wrong cluster) or cannot be read."""
    unchecked = ssl.create_default_context()
    unchecked.check_hostname = False
    unchecked.verify_mode = ssl.CERT_NONE  # NOTE: what is fetched is checked by its hash
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as s,
            s.get(base_url + "/v1/join/ca", ssl=unchecked) as r,
        ):
            pem = await r.content.read(MAX_BODY)
        ca = x509.load_pem_x509_certificate(pem)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise JoinError(f"cannot reach the join service at {base_url}: {exc}") from None
    except ValueError:
        raise JoinError(f"{base_url} did not answer with a CA certificate") from None
    if pki.key_hash(ca) != ca_hash:
        raise JoinError(
            f"the CA at {base_url} is not the one pinned ({pki.key_hash(ca)} is not {ca_hash}):"
            " refusing to send the token"
        )
    return ca


async def join(
    base_url: str, token: str, ca_hash: str, node: str, ips: tuple[str, ...] = ()
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, x509.Certificate, tuple[str, ...]]:
    """Join as `node`: (its key, made here; its certificate; the CA; the cluster's etcd
    endpoints). JoinError says why not."""
    ca = await fetch_ca(base_url, ca_hash)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = pki.request(key, node, "agent", ips).decode()
    trusted = ssl.create_default_context(
        cadata=ca.public_bytes(serialization.Encoding.PEM).decode()
    )
    trusted.check_hostname = False  # NOTE: the service's certificate names its node, not the URL
    body: dict[str, Any] = {"token": token, "node": node, "csr": csr}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as s,
            s.post(base_url + "/v1/join", json=body, ssl=trusted) as r,
        ):
            answer = await r.json(content_type=None)
            status = r.status
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise JoinError(f"the join service at {base_url} failed: {exc}") from None
    if status != 200 or not isinstance(answer, dict):
        why = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        raise JoinError(f"join refused ({status}): {why or 'no reason given'}")
    try:
        cert = x509.load_pem_x509_certificate(str(answer.get("cert", "")).encode())
        pki.verify(cert, ca, usage="client", node=node)
    except (ValueError, pki.PkiError) as exc:
        raise JoinError(f"the join service answered with an unusable certificate: {exc}") from None
    etcd = answer.get("etcd")
    if not (isinstance(etcd, list) and 0 < len(etcd) <= 16 and all(map(_endpoint, etcd))):
        raise JoinError("the join service named no etcd endpoint (HOST:PORT)")
    return key, cert, ca, tuple(etcd)


def _endpoint(value: object) -> bool:
    """Whether `value` reads HOST:PORT (an etcd endpoint as the service names it)."""
    if not isinstance(value, str) or len(value) > 256:
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
