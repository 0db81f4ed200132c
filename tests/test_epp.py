"""cgn-router as a gateway's endpoint picker (#61), driven as Envoy drives one: Envoy's own
ext_proc stubs, headers SENT, bodies FULL_DUPLEX_STREAMED (harness/gateway_standin.py, a
test stand-in for the gateway). One router (OpenAI surface and picker in one process) over
two cgn-infer sim engines for the module."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgn_core.bundled_models import smollm2
from cgn_router.epp import address
from harness.gateway_standin import (
    ExtProc,
    GatewayStandIn,
    body_message,
    headers_message,
    response_headers_message,
)
from harness.poll import until
from harness.procs import Router, cgn_infer_engines, cgn_router

MODEL = "smol"
CHAT = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, list[str]]]:
    tmp = tmp_path_factory.mktemp("epp")
    sim = ("--backend", "sim", "--engines", "2", "--speed", "50", "--model-name", MODEL)
    with cgn_infer_engines(tmp, 1, *sim) as engines:
        config = {
            "discovery": "static",
            "models": {MODEL: {"tokenizer": str(smollm2())}},
            "endpoints": {f"e{i}": {"url": e.url, "model": MODEL} for i, e in enumerate(engines)},
            "epp": {"enabled": True, "port": 0, "health_port": 0, "body_timeout_s": 1.0},
            "max_body_bytes": 256 << 10,
            "admission": {"bands": {
                "gold": {"priority": 1}, "shed": {"priority": 2, "ceiling": 0.01, "queue": 0},
            }},
        }  # fmt: skip
        with cgn_router(tmp, config) as router:
            yield router, [e.url for e in engines]


WIRE = Path(__file__).with_name("fixtures") / "ext_proc"


def test_our_messages_are_envoys_on_the_wire() -> None:
    """Recorded with Envoy's own generated stubs (fixtures/ext_proc/README.md): read by
    ours field for field, and our answers written byte for byte as Envoy's stubs wrote."""
    from google.protobuf import struct_pb2

    from cgn_proto.cognitora.v1 import ext_proc_pb2 as pb

    req = pb.ProcessingRequest.FromString((WIRE / "request_headers.bin").read_bytes())
    headers = {h.key: h.raw_value for h in req.request_headers.headers.headers}
    assert headers[":path"] == b"/v1/chat/completions" and not req.request_headers.end_of_stream
    hint = req.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    subset = hint.fields["x-gateway-destination-endpoint-subset"].list_value.values
    assert [v.string_value for v in subset] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    body = pb.ProcessingRequest.FromString((WIRE / "request_body.bin").read_bytes())
    assert body.request_body.body == b'{"model": "m"}' and body.request_body.end_of_stream
    rh = pb.ProcessingRequest.FromString((WIRE / "response_headers.bin").read_bytes())
    lb = rh.metadata_context.filter_metadata["envoy.lb"]
    assert lb.fields["x-gateway-destination-endpoint-served"].string_value == "10.0.0.2:8000"

    chosen = "10.0.0.1:8000,10.0.0.2:8000"
    meta = struct_pb2.Struct()
    meta.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"
    ].string_value = chosen
    option = pb.HeaderValueOption(
        header=pb.HeaderValue(key="x-gateway-destination-endpoint", raw_value=chosen.encode())
    )
    picked = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[option], remove_headers=["authorization"]),
            clear_route_cache=True)),
        dynamic_metadata=meta,
    )  # fmt: skip
    ctype = pb.HeaderValueOption(header=pb.HeaderValue(key="content-type",
                                                       raw_value=b"application/json"))  # fmt: skip
    refused = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=429), body=b'{"error": {}}', details="queue_full",
        headers=pb.HeaderMutation(set_headers=[ctype])))  # fmt: skip
    chunk = pb.StreamedBodyResponse(body=b"data: x\n\n", end_of_stream=False)
    streamed = pb.ProcessingResponse(response_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=chunk))))  # fmt: skip
    for name, ours in (("picked", picked), ("refused", refused), ("streamed", streamed)):
        assert ours.SerializeToString(deterministic=True) == (WIRE / f"{name}.bin").read_bytes()


def picker(router: Router) -> str:
    return f"127.0.0.1:{router.ports['epp']}"


def chat(text: str, **extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return json.dumps({**body, **extra}).encode()


def in_flight(router: Router) -> dict[str, int]:
    eps = httpx.get(router.admin + "/endpoints", timeout=10).json()["endpoints"]
    return {address(e["url"]): e["in_flight"] for e in eps}


async def test_the_pick_is_in_the_header_and_the_metadata_alike_with_the_engines_body(
    fleet: tuple[Router, list[str]],
) -> None:
    """...and the headers an engine trusts from its router only are the picker's: a
    client's (passed on by the gateway) are removed, or replaced by the tenant's."""
    router, urls = fleet
    forged = {"x-cgn-kv-salt": "someone-else", "authorization": "Bearer sk-client",
              "x-cgn-token-ids": "1", "x-cgn-priority": "0"}  # fmt: skip
    async with ExtProc(picker(router)) as ext:
        body = chat("Hello there, how are you?")
        got = await ext.pick({**CHAT, **forged}, body, chunk=7)  # a body in many chunks
    assert got.status == 0 and got.header == got.metadata
    first = got.header.split(",")
    assert first[0] in {address(u) for u in urls} and len(first) == 2  # fallback: the other
    assert json.loads(got.body) == json.loads(body)  # cgn-infer takes it as the client sent it
    assert got.headers["content-length"] == str(len(got.body))
    # sim engines have no secret: the client's key never reaches them; no tenant: no salt
    assert {"authorization", "x-cgn-kv-salt", "x-cgn-token-ids"} <= set(got.removed)
    assert got.headers["x-cgn-priority"] == "1"  # gold's, not the client's 0
    async with ExtProc(picker(router)) as ext:
        tenant = {**CHAT, **forged, "x-gateway-inference-fairness-id": "acme"}
        got = await ext.pick(tenant, chat("Hello"))
    assert got.headers["x-cgn-kv-salt"] not in ("", "someone-else")


async def test_a_subset_hint_is_obeyed_and_an_empty_or_foreign_one_is_a_503(
    fleet: tuple[Router, list[str]],
) -> None:
    router, urls = fleet
    only = address(urls[1])
    for i in range(3):
        async with ExtProc(picker(router)) as ext:
            got = await ext.pick(CHAT, chat(f"question {i}"), subset=[only])
        assert got.header == only == got.metadata  # no fallback outside the subset
    for subset in ([], ["10.9.9.9:8000"]):
        async with ExtProc(picker(router)) as ext:
            got = await ext.pick(CHAT, chat("anything"), subset=subset)
        assert got.status == 503 and got.error["error"]["code"] == "no_endpoint", got


@pytest.mark.parametrize(
    ("headers", "body", "status", "words"),
    [
        (CHAT, b"{not json", 400, "JSON"),
        (CHAT, chat("hi", model="nope"), 404, "nope"),
        ({**CHAT, ":path": "/v1/images"}, chat("hi"), 404, "no such path"),
        (CHAT, chat("hi", lora="x"), 400, "lora"),
        (CHAT, b"x" * (300 << 10), 413, "larger than"),
    ],
)  # fmt: skip
async def test_bad_requests_get_an_immediate_openai_error(
    fleet: tuple[Router, list[str]], headers: dict[str, str], body: bytes, status: int, words: str
) -> None:
    router, _ = fleet
    async with ExtProc(picker(router)) as ext:
        got = await ext.pick(headers, body, chunk=64 << 10)
    assert got.status == status and words in got.error["error"]["message"], got


async def test_a_body_that_never_ends_is_a_408_and_a_client_gone_mid_body_costs_nothing(
    fleet: tuple[Router, list[str]],
) -> None:
    router, _ = fleet
    async with ExtProc(picker(router)) as ext:
        await ext.send(headers_message(CHAT))
        await ext.send(body_message(b'{"model": "smol", ', False))
        got = await ext.picked()  # epp.body_timeout_s is 1 s here
    assert got.status == 408, got
    async with ExtProc(picker(router)) as ext:
        await ext.send(headers_message(CHAT))
        await ext.send(body_message(b'{"model": "smol", ', False))
        await asyncio.sleep(0.2)
        ext.cancel()
    async with ExtProc(picker(router)) as ext:  # the picker serves on
        assert (await ext.pick(CHAT, chat("still there?"))).header
    until("nothing in flight", lambda: set(in_flight(router).values()) == {0}, timeout_s=10)


async def test_shedding_is_a_429_and_the_served_endpoint_carries_the_load(
    fleet: tuple[Router, list[str]],
) -> None:
    """A request picked and not yet answered holds its place in admission and its lease:
    the `shed` band (ceiling 0.01, no queue) is refused with GIE's 429 meanwhile. The
    gateway reports it served the request elsewhere: the lease moves there. Its answer is
    relayed chunk by chunk, each before the next is sent."""
    router, urls = fleet
    async with ExtProc(picker(router)) as held:
        got = await held.pick(CHAT, chat("a long one", stream=True))
        chosen = got.header.split(",")[0]
        async with ExtProc(picker(router)) as ext:
            shed = await ext.pick({**CHAT, "x-gateway-inference-objective": "shed"}, chat("hi"))
        assert shed.status == 429, shed
        other = next(address(u) for u in urls if address(u) != chosen)
        assert in_flight(router) == {chosen: 1, other: 0}
        await held.send(response_headers_message(200, "text/event-stream", other))
        assert (await held.receive()).HasField("response_headers")
        assert in_flight(router) == {chosen: 0, other: 1}
        for chunk in (b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"):
            await held.send(body_message(chunk, False, response=True))
            answer = await held.receive(timeout_s=5)  # unbuffered: before the next chunk
            assert answer.response_body.response.body_mutation.streamed_response.body == chunk
        await held.send(body_message(b"", True, response=True))
        assert (await held.receive()).HasField("response_body")
    until("nothing in flight", lambda: set(in_flight(router).values()) == {0}, timeout_s=10)


async def test_health_says_live_at_once_and_ready_once_the_fleet_is_known(
    fleet: tuple[Router, list[str]],
) -> None:
    router, _ = fleet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.ports['epp_health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            got = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service


def _hit_rate(answers: list[dict[str, Any]]) -> float:
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    cached = sum((a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for a in answers)  # fmt: skip
    return cached / prompt


async def _replay(
    url: str, seed: str, chats: int, turns: int, headers: dict[str, str] | None = None,
    check: Router | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """`chats` conversations of `turns` turns, each turn sending the whole chat so far; with
    `check`, each pick is one that router's own decision allowed just before it was sent
    (`/debug/route`: the best total, ties included)."""
    answers = []
    convs: list[list[dict[str, str]]] = [[] for _ in range(chats)]
    async with httpx.AsyncClient(timeout=60, headers=headers) as client:
        for turn in range(turns):
            for i, msgs in enumerate(convs):
                words = f"{seed} chat {i} turn {turn}: " + "words " * 40
                msgs.append({"role": "user", "content": words})
                best = set()
                if check is not None:
                    asked = {"model": MODEL, "messages": msgs}
                    why = (await client.post(check.admin + "/debug/route", json=asked)).json()
                    totals = {
                        c["id"]: c["total"] for c in why["candidates"] if c["total"] is not None
                    }
                    best = {e for e, t in totals.items() if t >= max(totals.values()) - 1e-9}
                body = {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0}
                r = await client.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                if check is not None:
                    eps = (await client.get(check.admin + "/endpoints")).json()["endpoints"]
                    ids = {address(e["url"]): e["id"] for e in eps}
                    assert ids[r.headers["x-cognitora-endpoint"]] in best
                answers.append(r.json())
                text = answers[-1]["choices"][0]["message"]["content"]
                msgs.append({"role": "assistant", "content": text})
    return answers


async def test_behind_a_gateway_picks_are_the_routers_and_kv_hits_the_proxys(
    fleet: tuple[Router, list[str]],
) -> None:
    """Through the gateway stand-in, every pick is one the router's own decision allows
    at that moment; and a conversation replay (4 chats x 4 turns) hits the KV cache as
    the same replay through the OpenAI surface does, within 2 points (the same prompts:
    the gateway's as a tenant of its own, `x-gateway-inference-fairness-id`, cached apart
    from the OpenAI surface's anonymous ones)."""
    router, _ = fleet
    async with GatewayStandIn(picker(router)) as gateway:
        await _replay(gateway.url, "decided", 2, 3, check=router)
        tenant = {"x-gateway-inference-fairness-id": "replay"}
        through_gateway = await _replay(gateway.url, "replay", 4, 4, tenant)
    through_proxy = await _replay(router.url, "replay", 4, 4)
    gw, px = _hit_rate(through_gateway), _hit_rate(through_proxy)
    assert abs(gw - px) <= 0.02 and gw > 0.5, (gw, px)  # the replay reuses its prefixes


async def test_health_is_not_ready_before_the_fleet_is_known(tmp_path: Path) -> None:
    """etcd unreachable: the picker is alive (the gateway's liveness probe passes) but not
    ready, so a gateway sends it nothing yet (readiness and the ext_proc service)."""
    from cgn_core.etcd.local import free_port

    dead = f"127.0.0.1:{free_port()}"
    config = {"etcd": {"endpoints": [dead], "timeout_s": 0.5},
              "epp": {"enabled": True, "port": 0, "health_port": 0}}  # fmt: skip
    with cgn_router(tmp_path, config) as router:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.ports['epp_health']}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(service: str) -> int:
                got = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                return int(got.status)

            assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING
            for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await status(service) == health_pb2.HealthCheckResponse.NOT_SERVING
