"""cgn-router as the endpoint picker of a Kubernetes gateway (#61): the Gateway API Inference
Extension's EPP protocol over Envoy's ext_proc (envoy.service.ext_proc.v3; the messages it
uses, wire-compatible, in proto/cognitora/v1/ext_proc.proto).

The gateway (Envoy Gateway, kgateway, Istio, GKE, NGINX Gateway Fabric) proxies the bytes;
for each request it opens one ext_proc stream and this module picks the pod:

    gateway                                        cgn-router --epp
      request headers   ────────────────────────▶  kept (nothing answered yet)
      request body, in chunks (FULL_DUPLEX_STREAMED) ▶  buffered: at most max_body_bytes
                                                    (413), ended within epp.body_timeout_s
                                                    (408); then parsed, hashed, admitted
                                                    (admit.py) and routed (legs.route) as the
                                                    OpenAI surface does, within the gateway's
                                                    subset hint when it sends one
      ◀── headers: x-gateway-destination-endpoint (and the same in `envoy.lb` dynamic
          metadata), the engine's secret, KV salt and priority; then the body as the
          engine takes it (its adapter and salt fields: proxy.upstream_request)
      response headers  ────────────────────────▶  the endpoint that served (envoy.lb
                                                    x-gateway-destination-endpoint-served)
      response body, in chunks ─────────────────▶  each passed straight back (unbuffered);
                                                    its usage read for the accounts

A refusal is an ImmediateResponse with the OpenAI error body: 400 a body that is not
JSON, 404 an unknown model or path, 408 a body that never ends, 413 one too large, 429
when admission sheds or a budget is spent, 503 when no endpoint (or none in the subset)
can take it. One stream is one request: its failure ends that stream only.

What differs from the proxy: the gateway retries (down the fallback list, endpoints that
share the chosen one's secret) and nothing migrates a broken stream; the lease on the pod
is held from the pick to the end of the answer, and moved to the pod that served when the
gateway fell back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from google.protobuf import struct_pb2

from cgn_core.errors import (
    CognitoraError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    Unauthorized,
    Unavailable,
    openai_error_body,
)
from cgn_core.http import KV_SALT_HEADER, PRIORITY_HEADER
from cgn_core.kv.blockhash import tenant_salt
from cgn_core.kv.transfer import HEADER as TRANSFER_HEADER
from cgn_core.openai.resume import IDS_HEADER
from cgn_core.settings import TlsSettings
from cgn_core.tls import server_credentials
from cgn_proto.cognitora.v1 import ext_proc_pb2 as pb
from cgn_router.adapters import place
from cgn_router.admit import Admission, admission, budgeted
from cgn_router.attempt import Attempt
from cgn_router.auth import Principal
from cgn_router.legs import PATHS, route_decision
from cgn_router.proxy import Call, upstream_request, usage_chunk, usage_of
from cgn_router.routing.lifecycle import Account, AttemptEnded, Ended, Refused
from cgn_router.service import RouterService
from cgn_router.settings import EppSettings
from cgn_router.types import EndpointId, EndpointView, RequestInfo, Usage

log = logging.getLogger(__name__)
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
FAIRNESS = "x-gateway-inference-fairness-id"  # the tenant, where no API key names one
OBJECTIVE = "x-gateway-inference-objective"  # the band, where it names a configured one
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_SUBSET = 4096  # endpoints a subset hint may name
MAX_HEADER = 8 << 10  # a header value read, at most (longer ones are cut)
USAGE_TAIL = 64 << 10  # the end of an answer kept to read its usage
KINDS = {path: kind for kind, path in PATHS.items()}
# what an engine takes from its secret's bearer only, and the client's key (never an engine's)
ROUTER_ONLY = frozenset(
    {"authorization", KV_SALT_HEADER, PRIORITY_HEADER, IDS_HEADER, TRANSFER_HEADER}
)


def address(url: str) -> str:
    """An endpoint's `host:port`, as the gateway dials it."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def handler(picker: Picker) -> grpc.GenericRpcHandler:
    """The ext_proc service under Envoy's name (our messages are wire-compatible with its)."""
    process = grpc.stream_stream_rpc_method_handler(
        picker.Process,
        request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=pb.ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": process})


class Picker:
    """The ext_proc service: one `_Stream` per gateway stream (one HTTP request)."""

    def __init__(self, svc: RouterService, settings: EppSettings):
        self.svc, self.settings = svc, settings

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> None:
        stream = _Stream(self.svc, self.settings, context)
        try:
            await stream.run()
        except asyncio.CancelledError:  # the gateway cancelled (its client left)
            stream.outcome = "client_disconnected"
            raise
        finally:
            stream.close()


@dataclass
class _Stream:
    """One request's exchange with the gateway, from its headers to its answer's end."""

    svc: RouterService
    settings: EppSettings
    context: Any  # grpc.aio.ServicerContext
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    acct: Account | None = None
    status: int = 0  # the HTTP status of the answer (0: none yet)
    error: str = ""
    outcome: str = "client_disconnected"
    adm: Admission | None = None
    lease: Attempt | None = None
    view: EndpointView | None = None
    req: RequestInfo | None = None
    first_byte: bool = False
    tail: bytearray = field(default_factory=bytearray)
    usage: Usage | None = None
    trailers: bool = False  # the body ended with trailers: answered after it
    attempt: int = 0  # its number in the account (the trace's span)
    _exits: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def _read(self, until: float | None) -> pb.ProcessingRequest | None:
        """The next message (None at the stream's end); RequestTimeout past `until`."""
        read = self.context.read()
        if until is None:
            got = await read
        else:
            try:
                got = await asyncio.wait_for(read, max(0.0, until - time.monotonic()))
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.settings.body_timeout_s:g} s"
                ) from None
        return None if got is grpc.aio.EOF else got

    async def run(self) -> None:
        try:
            await self._request()
        except CognitoraError as err:
            self.status, self.error = _status(err), err.code or type(err).__name__
            # NOTE: as on the OpenAI surface, a request refused before routing is counted by
            # its refusal, not as a request (outcome "")
            self.outcome = "no_endpoint" if err.code == "no_endpoint" else ""
            await self.context.write(_immediate(self.status, err))
            return
        await self._answer()

    async def _request(self) -> None:
        """Headers and body in, the pick out (CognitoraError: the refusal to send)."""
        first = await self._read(None)
        if first is None or not first.HasField("request_headers"):
            raise InvalidRequest("the stream must open with the request's headers")
        self._keep_headers(first)
        path = self.headers.get(":path", "").split("?", 1)[0]
        kind = KINDS.get(path)
        self.acct = self.svc.account(kind or "completion", self.headers)
        if kind is None:
            raise NotFound(f"no such path: {path[:200]}")
        if self.headers.get(":method", "POST") != "POST":
            raise InvalidRequest(f"{self.headers[':method'][:20]} is not allowed on {path}")
        who = self._principal(self.acct)
        budgeted(self.svc, who, self.acct)
        if first.request_headers.end_of_stream:
            raise InvalidRequest("the request has no body")
        await self._body()
        self.adm = await self._exits.enter_async_context(
            admission(self.svc, kind, bytes(self.body), who, self.acct)
        )
        await self._pick(kind, self.adm)

    def _keep_headers(self, msg: pb.ProcessingRequest) -> None:
        for h in msg.request_headers.headers.headers[:256]:
            value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            self.headers[h.key.lower()[:256]] = value[:MAX_HEADER]
        hint = msg.metadata_context.filter_metadata.get(self.settings.subset_namespace)
        if hint is not None and SUBSET in hint.fields:
            listed = hint.fields[SUBSET].list_value.values
            self.subset = frozenset(v.string_value[:256] for v in listed[:MAX_SUBSET])

    def _principal(self, acct: Account) -> Principal:
        """The API key's principal where auth is on (the gateway passes the client's
        Authorization on); else the gateway's fairness id as the tenant, its objective as
        the band where it names one."""
        auth = self.svc.settings.auth
        if auth.enabled:
            try:
                return self.svc.principal(self.headers.get("authorization"))
            except Unauthorized:
                acct.emit(Refused("-", "unauthorized"))
                raise
        fairness = self.headers.get(FAIRNESS, "")[:128]
        objective = self.headers.get(OBJECTIVE, "")
        band = self.settings.objectives.get(objective, objective)
        band = band if band in self.svc.settings.admission.bands else auth.anonymous_band
        # NOTE: a fairness id is a tenant: its prompts are cached apart (as a key's tenant's
        # are); without one, the anonymous tenant's are unsalted, as on the OpenAI surface
        salt = tenant_salt("tenant", fairness) if auth.kv_isolation and fairness else None
        return Principal("", fairness or auth.anonymous_tenant, band, kv_salt=salt)

    async def _body(self) -> None:
        """The request's body, whole: bounded in size and time."""
        until = time.monotonic() + self.settings.body_timeout_s
        limit = self.svc.settings.max_body_bytes
        while True:
            msg = await self._read(until)
            if msg is None:
                raise InvalidRequest("the request ended before its body did")
            if msg.HasField("request_trailers"):
                self.trailers = True
                return
            if not msg.HasField("request_body"):
                raise InvalidRequest("expected the request's body")
            self.body += msg.request_body.body
            if len(self.body) > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            if msg.request_body.end_of_stream:
                return

    async def _pick(self, kind: str, adm: Admission) -> None:
        svc, acct = self.svc, self.acct
        assert acct is not None
        adapter = adm.adapter
        barred = frozenset[EndpointId]()
        if adapter is not None:
            barred = await place(
                svc, adm.model, adapter, adm.started + svc.settings.deadlines.total_s
            )
        if self.subset is not None:
            barred |= {
                eid
                for eid, st in svc.registry.by_model.get(adm.model, {}).items()
                if address(st.endpoint.url) not in self.subset
            }
        role = "decode" if svc.registry.has_prefill_pool(adm.model) else "both"
        session = self.headers.get(svc.settings.routing.session_header) or adm.body.get("user")
        self.req = req = RequestInfo(
            adm.model, role, adm.prompt.blocks, adm.prompt.tokens,
            session if isinstance(session, str) else None, adapter,
        )  # fmt: skip
        decision = route_decision(svc, req, barred, acct)
        view = decision.view
        if view is None:
            where = " in the gateway's subset" if self.subset is not None else ""
            raise Unavailable(f"no ready endpoint{where} serves model '{adm.model}'",
                              code="no_endpoint")  # fmt: skip
        self.view = view
        self.lease = Attempt(svc.registry, view, req, streamed=adm.stream)
        call = Call(
            endpoint=view.endpoint, path=PATHS[kind], payload=bytes(self.body),
            stream=adm.stream, strip_usage=False, served_model=adm.model,
            total_at=adm.started + svc.settings.deadlines.total_s, response_headers={},
            priority=svc.engine_priority(adm.who.band), kv_salt=adm.who.kv_salt,
            adapter=(adapter, adm.scale) if adapter else None,
        )  # fmt: skip
        self.attempt, trace = acct.attempt("upstream", view.id, view.endpoint.url)
        headers, payload = upstream_request(dataclasses.replace(call, trace_headers=trace or None))
        chosen = ",".join([address(view.endpoint.url), *self._fallbacks(decision.totals, view)])
        await self.context.write(_picked(chosen, headers, len(payload), self.settings))
        await self.context.write(_body_response(payload))
        if self.trailers:
            await self.context.write(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))

    def _fallbacks(self, totals: Mapping[EndpointId, float], view: EndpointView) -> list[str]:
        """Where the gateway may retry: the next best endpoints of the decision that share
        the chosen one's secret (the gateway sends one Authorization header to whichever
        it tries)."""
        if self.settings.fallbacks == 0:
            return []
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])
        states = self.svc.registry.states
        out = []
        for eid, _ in ranked:
            if eid == view.id:
                continue
            st = states.get(eid)
            if st is not None and st.endpoint.token == view.endpoint.token:
                out.append(address(st.endpoint.url))
            if len(out) >= self.settings.fallbacks:
                break
        return out

    async def _answer(self) -> None:
        """The answer's headers, body and trailers, each passed back as it comes."""
        while True:
            msg = await self._read(None)
            if msg is None:
                return
            if msg.HasField("response_headers"):
                self._served(msg)
                await self.context.write(
                    pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                )
            elif msg.HasField("response_body"):
                chunk, end = msg.response_body.body, msg.response_body.end_of_stream
                if chunk and not self.first_byte and self.lease is not None:
                    self.first_byte = True
                    self.lease.lease.first_byte(time.monotonic())
                self.tail += chunk
                del self.tail[: max(0, len(self.tail) - USAGE_TAIL)]
                await self.context.write(_body_response(chunk, end, response=True))
                if end:
                    self._ended()
            elif msg.HasField("response_trailers"):
                self._ended()
                await self.context.write(
                    pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
                )
            elif msg.HasField("request_trailers"):
                await self.context.write(
                    pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                )

    def _served(self, msg: pb.ProcessingRequest) -> None:
        """The answer's status, and the endpoint that served it: where the gateway fell back
        to another, the lease moves there (the first one failed it)."""
        for h in msg.response_headers.headers.headers[:256]:
            if h.key == ":status":
                raw = h.raw_value.decode("ascii", "replace") if h.raw_value else h.value
                self.status = int(raw) if raw.isdigit() and len(raw) == 3 else 0
        meta = msg.metadata_context.filter_metadata.get(self.settings.metadata_namespace)
        served = meta.fields[SERVED].string_value[:256] if meta and SERVED in meta.fields else ""
        view, req = self.view, self.req
        if not served or view is None or req is None or served == address(view.endpoint.url):
            return
        other = next(
            (v for v in self.svc.registry.views(req, time.monotonic(), frozenset())
             if address(v.endpoint.url) == served),
            None,
        )  # fmt: skip
        if other is None or self.lease is None or self.adm is None:
            return
        self.lease.outcome = "failed"
        self.lease.__exit__(None, None, None)
        self.view, self.lease = (
            other,
            Attempt(self.svc.registry, other, req, streamed=self.adm.stream),
        )

    def _ended(self) -> None:
        """The answer's end: how it went, for the lease (the breaker counts an engine's 5xx)
        and the request, and what it cost."""
        if self.lease is None or self.outcome != "client_disconnected":
            return
        self.usage = _usage(bytes(self.tail))
        if 200 <= self.status < 300:
            self.outcome = self.lease.outcome = "ok"
        elif self.status < 500:
            self.outcome = self.lease.outcome = "client_error"
        else:
            self.outcome, self.lease.outcome = "upstream_error", "failed"
        if self.adm is not None:
            self.adm.settle(self.usage)

    def close(self) -> None:
        """However the stream ended: the lease, the attempt's and the request's records,
        and admission given back (in the background: the exit stack awaits nothing long)."""
        acct = self.acct
        if self.lease is not None and self.view is not None and self.req is not None and acct:
            lease = self.lease.lease
            first = lease.first_byte_at
            started = self.adm.started if self.adm else lease.began_at
            since = None if first is None else first - started
            sample = lease.sample(self.usage) if self.outcome == "ok" and self.first_byte else None
            self.lease.__exit__(None, None, None)
            v = self.view
            acct.emit(AttemptEnded(self.attempt, self.req.model, "client", self.lease.outcome,
                                   "", since, self.usage, lease.predicted, False, v.id,
                                   v.endpoint.engine, v.predicted_ttft_s, sample))  # fmt: skip
        exits = self._exits
        task = asyncio.get_running_loop().create_task(exits.aclose())
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        if acct is not None:
            seconds = time.monotonic() - acct.started
            who = (acct.tenant, acct.endpoint, acct.key_id, acct.adapter)
            acct.emit(Ended(acct.model or "-", self.outcome, self.status or 499, seconds,
                            self.usage, self.error, *who))  # fmt: skip


def _status(err: CognitoraError) -> int:
    """The HTTP status the gateway answers with: GIE's 429 for a request shed."""
    return 429 if isinstance(err, (Overloaded, RateLimited)) else err.http_status


def _immediate(status: int, err: CognitoraError) -> pb.ProcessingResponse:
    body = json.dumps(openai_error_body(err)).encode()
    mutation = pb.HeaderMutation(set_headers=[_header("content-type", "application/json")])
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=pb.HttpStatus(code=status),
            headers=mutation,
            body=body,
            details=(err.code or type(err).__name__)[:100],
        )
    )


def _header(key: str, value: str) -> pb.HeaderValueOption:
    return pb.HeaderValueOption(header=pb.HeaderValue(key=key, raw_value=value.encode()))


def _picked(
    chosen: str, headers: Mapping[str, str], length: int, settings: EppSettings
) -> pb.ProcessingResponse:
    """The request headers' answer: the destination in header and metadata (the same value),
    the engine's headers, the body's new length; and the headers only a router may send
    removed where it sends none (the gateway passes the client's on: an engine trusts its
    secret's bearer with them)."""
    engine = {k.lower(): v for k, v in headers.items() if k.lower() != "content-type"}
    sets = [_header(DESTINATION, chosen), _header("content-length", str(length))]
    sets += [_header(k, v) for k, v in engine.items()]
    removed = sorted(ROUTER_ONLY - set(engine))
    meta = struct_pb2.Struct()
    meta.fields[settings.metadata_namespace].struct_value.fields[DESTINATION].string_value = chosen
    mutation = pb.HeaderMutation(set_headers=sets, remove_headers=removed)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=meta,
    )


def _body_response(
    chunk: bytes, end: bool = True, *, response: bool = False
) -> pb.ProcessingResponse:
    mutation = pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end)
    )
    body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    return (
        pb.ProcessingResponse(response_body=body)
        if response
        else pb.ProcessingResponse(request_body=body)
    )


def _usage(tail: bytes) -> Usage | None:
    """The usage in the end of an answer: a whole JSON body's, or a stream's last usage
    chunk (read as the proxy reads them)."""
    text = tail.strip()
    if text.startswith(b"{"):
        try:
            return usage_of(json.loads(text))
        except ValueError:
            pass
    lines = (line.strip() for line in reversed(text.split(b"\n")))
    return next((got for line in lines if (got := usage_chunk(line)) is not None), None)


@dataclass
class Servers:
    """The picker's gRPC server and its health server, running."""

    picker: Any  # grpc.aio.Server
    probes: Any
    ready: asyncio.Task[None]

    async def stop(self, grace_s: float) -> None:
        """Streams in flight get `grace_s` to end (the gateway's requests), then both stop."""
        self.ready.cancel()
        await self.picker.stop(grace_s)
        await self.probes.stop(0)


async def serve(
    svc: RouterService, settings: EppSettings, tls: TlsSettings | None = None
) -> tuple[Servers, int, int]:
    """The picker's gRPC server and its health server, started: (servers, ext_proc port,
    health port). Health (grpc.health.v1): `liveness` serves from the start; `readiness`,
    the ext_proc service and "" once the router knows its fleet (`svc.in_sync`)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server(maximum_concurrent_rpcs=settings.max_streams)
    server.add_generic_rpc_handlers((handler(Picker(svc, settings)),))
    where = f"{settings.host}:{settings.port}"
    if tls is not None and tls.enabled:
        port = server.add_secure_port(where, server_credentials(tls))
    else:
        port = server.add_insecure_port(where)
    checks = health.aio.HealthServicer()
    probes = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(checks, probes)
    health_port = probes.add_insecure_port(f"{settings.host}:{settings.health_port}")
    await server.start()
    await probes.start()
    await checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in ("readiness", SERVICE, ""):
        await checks.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def ready() -> None:
        await svc.in_sync.wait()
        for name in ("readiness", SERVICE, ""):
            await checks.set(name, health_pb2.HealthCheckResponse.SERVING)

    task = asyncio.get_running_loop().create_task(ready())
    return Servers(server, probes, task), port, health_port
