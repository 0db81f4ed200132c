"""A TEST STAND-IN for a Kubernetes gateway (Envoy) in front of an endpoint picker (#61).

No Envoy runs here, so this plays its part of the Gateway API Inference Extension's EPP
protocol (docs/proposals/004-endpoint-picker-protocol) with Envoy's ext_proc messages (the
subset in proto/cognitora/v1/ext_proc.proto, wire-compatible), configured as GIE's
reference Envoy is: request and response headers SENT, bodies FULL_DUPLEX_STREAMED,
trailers SENT.

* `ExtProc`: one ext_proc stream driven message by message (the conformance tests).
* `GatewayStandIn`: an HTTP server that, per request, asks the picker over ext_proc, sends
  the request to the endpoint it names with its header and body mutations, and relays
  the answer back through the picker to the client, chunk by chunk (end-to-end tests and
  the bench). It is not a gateway: no retries down the fallback list, no TLS, no routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from google.protobuf import struct_pb2

from cgn_proto.cognitora.v1 import ext_proc_pb2 as pb

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"  # Envoy's method
DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
HOP_BY_HOP = frozenset({"host", "connection", "content-length", "transfer-encoding", "keep-alive"})


def headers_message(
    headers: Mapping[str, str], *, end: bool = False, subset: Iterable[str] | None = None
) -> pb.ProcessingRequest:
    hm = pb.HeaderMap(
        headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields[SUBSET].list_value.extend(list(subset))
        msg.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return msg


def body_message(chunk: bytes, end: bool, *, response: bool = False) -> pb.ProcessingRequest:
    body = pb.HttpBody(body=chunk, end_of_stream=end)
    return (
        pb.ProcessingRequest(response_body=body)
        if response
        else pb.ProcessingRequest(request_body=body)
    )


def response_headers_message(status: int, content_type: str, served: str) -> pb.ProcessingRequest:
    hm = pb.HeaderMap(headers=[
        pb.HeaderValue(key=":status", raw_value=str(status).encode()),
        pb.HeaderValue(key="content-type", raw_value=content_type.encode()),
    ])  # fmt: skip
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))
    meta = struct_pb2.Struct()
    meta.fields[SERVED].string_value = served
    msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
    return msg


@dataclass
class Picked:
    """What the picker answered for a request: the destination (header and metadata), the
    other header mutations, and the body to send; or the immediate response."""

    header: str = ""
    metadata: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    body: bytes = b""
    status: int = 0  # an ImmediateResponse's status (0: none)
    error: dict[str, Any] = field(default_factory=dict)


class ExtProc:
    """One ext_proc stream, driven as Envoy drives it (`async with ExtProc(target) as s`)."""

    def __init__(self, target: str):
        self.target = target
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None

    async def __aenter__(self) -> ExtProc:
        self.channel = grpc.aio.insecure_channel(self.target)
        process = self.channel.stream_stream(
            PROCESS,
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )
        self.call = process(self._messages())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.queue.put(None)
        if self.call is not None:
            self.call.cancel()
        if self.channel is not None:
            await self.channel.close()

    async def _messages(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def send(self, msg: pb.ProcessingRequest) -> None:
        await self.queue.put(msg)

    async def end(self) -> None:
        """Half-close: Envoy sends nothing more on this stream."""
        await self.queue.put(None)

    async def receive(self, timeout_s: float = 30.0) -> pb.ProcessingResponse | None:
        got = await asyncio.wait_for(self.call.read(), timeout_s)
        return None if got is grpc.aio.EOF else got

    def cancel(self) -> None:
        """The client left: Envoy resets the stream."""
        self.call.cancel()

    async def pick(
        self, headers: Mapping[str, str], body: bytes, chunk: int = 0,
        subset: Iterable[str] | None = None,
    ) -> Picked:  # fmt: skip
        """Send a request's headers and body (in `chunk`-byte pieces; 0: one) and read the
        picker's answer to them."""
        await self.send(headers_message(headers, subset=subset))
        pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
        for i, piece in enumerate(pieces):
            await self.send(body_message(piece, i == len(pieces) - 1))
        return await self.picked()

    async def picked(self) -> Picked:
        first = await self.receive()
        assert first is not None, "the picker closed the stream without an answer"
        if first.HasField("immediate_response"):
            ir = first.immediate_response
            return Picked(status=ir.status.code, error=json.loads(ir.body or b"{}"))
        assert first.HasField("request_headers"), first
        out = Picked()
        mutation = first.request_headers.response.header_mutation
        for h in mutation.set_headers:
            out.headers[h.header.key] = h.header.raw_value.decode()
        out.removed = list(mutation.remove_headers)
        out.header = out.headers.get(DESTINATION, "")
        lb = first.dynamic_metadata.fields.get("envoy.lb")
        if lb is not None:
            out.metadata = lb.struct_value.fields[DESTINATION].string_value
        body = bytearray()
        while True:
            msg = await self.receive()
            assert msg is not None and msg.HasField("request_body"), msg
            streamed = msg.request_body.response.body_mutation.streamed_response
            body += streamed.body
            if streamed.end_of_stream:
                break
        out.body = bytes(body)
        return out


class GatewayStandIn:
    """An HTTP front that asks the picker at `picker` where each request goes (TEST
    STAND-IN: see the module's docstring)."""

    def __init__(self, picker: str):
        self.picker = picker
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.picks: list[str] = []  # where each request went, in order

    async def __aenter__(self) -> GatewayStandIn:
        self.session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/{path:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        headers = {":method": "POST", ":path": request.path, ":authority": request.host,
                   **{k.lower(): v for k, v in request.headers.items()}}  # fmt: skip
        async with ExtProc(self.picker) as ext:
            picked = await ext.pick(headers, body)
            if picked.status:
                return web.json_response(picked.error, status=picked.status)
            assert picked.header == picked.metadata, (picked.header, picked.metadata)
            target = picked.header.split(",")[0]
            self.picks.append(target)
            # as Envoy does: the client's headers on, the picker's removed and set
            sent = {k.lower(): v for k, v in request.headers.items()
                    if k.lower() not in HOP_BY_HOP and k.lower() not in picked.removed}  # fmt: skip
            sent |= {k: v for k, v in picked.headers.items() if k != DESTINATION}
            async with self.session.post(
                f"http://{target}{request.path}", data=picked.body, headers=sent
            ) as upstream:
                ctype = upstream.headers.get("content-type", "application/json")
                await ext.send(response_headers_message(upstream.status, ctype, target))
                got = await ext.receive()
                assert got is not None and got.HasField("response_headers"), got
                out = web.StreamResponse(status=upstream.status, headers={"content-type": ctype})
                out.headers["x-cognitora-endpoint"] = target
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await ext.send(body_message(chunk, False, response=True))
                    await out.write(_relayed(await ext.receive()))
                await ext.send(body_message(b"", True, response=True))
                await out.write(_relayed(await ext.receive()))
                with contextlib.suppress(ConnectionError):
                    await out.write_eof()
                return out


def _relayed(msg: pb.ProcessingResponse | None) -> bytes:
    assert msg is not None and msg.HasField("response_body"), msg
    return bytes(msg.response_body.response.body_mutation.streamed_response.body)
