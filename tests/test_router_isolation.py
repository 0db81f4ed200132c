"""What the router sends upstream: nothing one client's upstream answer set (cookies) rides
along on another client's request; each request carries its band's priority for the engine.
What it takes back: an answer larger than max_response_bytes is never held whole."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from cgn_core.etcd.local import free_port
from cgn_core.http import KV_SALT_HEADER
from cgn_router.proxy import Call, Proxy, with_field
from cgn_router.settings import DeadlineSettings
from cgn_router.types import Endpoint, EndpointId
from cgn_router.upstream import Upstream
from harness.procs import Router, cgn_router, stop, wait_http_ok

# An engine that sets a cookie on every answer and reports the Cookie and x-cgn-priority
# headers it received.
UPSTREAM = textwrap.dedent(
    """
    import gzip, json, sys
    from aiohttp import web

    async def complete(request):
        seen = request.headers.get("Cookie", "")
        body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": (seen or "no-cookie")
                                     + " priority=" + request.headers.get("x-cgn-priority", "-")}}]}
        resp = web.json_response(body)
        resp.set_cookie("engine_session", "client-a-secret")
        return resp

    async def huge(request):  # a broken or hostile engine: 1.5 GB declared, sent until cut
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1_500_000_000
        await resp.prepare(request)
        chunk = b" " * (1 << 20)
        for _ in range(1500):
            await resp.write(chunk)
        return resp

    async def gzipped(request):  # compresses though it was asked for identity only
        body = gzip.compress(json.dumps({"object": "list", "data": [],
                                         "asked": request.headers.get("Accept-Encoding")}).encode())
        return web.Response(body=body, headers={"Content-Type": "application/json",
                                                "Content-Encoding": "gzip"})

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", complete), web.get("/health", health),
                    web.post("/v1/completions", huge), web.post("/v1/embeddings", gzipped)])
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
    """
)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("isolation")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)], start_new_session=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, timeout_s=30)
        # a host name: aiohttp's default jar ignores cookies from bare IP addresses
        endpoint = {"url": f"http://localhost:{port}", "model": "m", "engine": "vllm"}
        config = {"discovery": "static", "endpoints": {"e": endpoint},
                  "max_response_bytes": 4 << 20}  # fmt: skip
        with cgn_router(Path(tmp), config) as r:
            yield r
    finally:
        stop(proc)


def ask(router: Router) -> tuple[str, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(router.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        content = json.load(resp)["choices"][0]["message"]["content"]
        return content, resp.headers.get("Set-Cookie", "")


def test_an_upstream_cookie_never_reaches_another_request(router: Router) -> None:
    first, set_cookie = ask(router)
    assert first.startswith("no-cookie ") and set_cookie == ""  # engine headers are not relayed
    second, _ = ask(router)
    assert second.startswith("no-cookie ")  # the router kept nothing for the next client


def test_each_request_carries_its_bands_priority_to_the_engine(router: Router) -> None:
    content, _ = ask(router)
    assert content.endswith(" priority=1")  # auth off: the anonymous band, gold (priority 1)


def test_an_answer_over_max_response_bytes_is_cut_not_buffered(router: Router) -> None:
    """A 1.5 GB non-streamed answer: the router reads 4 MiB and one byte, drops the
    connection and answers 502; its memory stays bounded and it keeps serving."""
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    req = urllib.request.Request(router.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    with refused.value as resp:  # NOTE: closed, or its socket warns in some later test
        assert resp.code == 502
        assert "max_response_bytes" in json.load(resp)["error"]["message"]
    rss = int(next(line.split()[1] for line in Path(f"/proc/{router.proc.pid}/status")
                   .read_text().splitlines() if line.startswith("VmHWM:")))  # fmt: skip
    assert rss < 400 << 10, f"the router's peak RSS reached {rss} KiB"
    assert ask(router)[0].startswith("no-cookie")


def test_an_answer_in_a_coding_the_router_did_not_accept_is_not_relayed(router: Router) -> None:
    """The router asks for identity; a gzipped answer would reach the client without its
    Content-Encoding (garbage), so it is a failed attempt (here the only engine: a 502)."""
    body = json.dumps({"model": "m", "input": "hi"}).encode()
    req = urllib.request.Request(router.url + "/v1/embeddings", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    with refused.value as resp:
        assert resp.code == 502
        assert "answered in 'gzip' coding" in json.load(resp)["error"]["message"]


class Recorded:
    """An `Upstream` stand-in that keeps what `Proxy` would have sent (no network)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, dict[str, str]]] = []

    def post(self, url: str, path: str, payload: bytes, headers: dict[str, str], _: float) -> Any:
        self.sent.append((payload, headers))
        return None


@pytest.mark.parametrize(
    ("engine", "in_body"), [("cgn-infer", False), ("vllm", True), ("sglang", True)]
)
def test_a_tenants_kv_salt_reaches_every_engine_in_the_form_it_takes(
    engine: str, in_body: bool
) -> None:
    """#58: the header to cgn-infer (which trusts it from the router's token only), and
    vLLM's and SGLang's `cache_salt` in the body; no salt, neither."""
    upstream = Recorded()
    proxy = Proxy(cast(Upstream, upstream), DeadlineSettings())
    endpoint = Endpoint(EndpointId("m/e"), "m", "http://e", engine=engine)
    payload = json.dumps({"model": "m", "prompt": "hi"}).encode()
    call = Call(endpoint, "/v1/completions", payload, False, False, "m", 0.0, {}, kv_salt="s1")
    proxy._post(call)
    proxy._post(dataclasses.replace(call, kv_salt=None))
    (salted, headers), (plain, plain_headers) = upstream.sent
    assert headers[KV_SALT_HEADER] == "s1" and KV_SALT_HEADER not in plain_headers
    assert json.loads(salted).get("cache_salt") == ("s1" if in_body else None)
    assert plain == payload


@pytest.mark.parametrize(
    "payload",
    [b'{"model": "m", "prompt": "hi"}', b'{}', b'{ }\n', b'{"a": {"b": [1, {}]}}  \r\n',
     b'{"model":"m","prompt":"x"}', b'{"return_token_ids": false, "prompt": "x"}',
     b'{"prompt": "say return_token_ids"}', '{"prompt": "\u00e9t\u00e9 été 🤖"}'.encode()],
)  # fmt: skip
def test_a_field_is_written_into_the_body_without_encoding_it_again(payload: bytes) -> None:
    """#64: the router's own field goes before the closing brace, the client's bytes as they
    were; where the name is written already, the engine still reads one key, the router's."""
    got = with_field(payload, "return_token_ids", True)
    assert json.loads(got) == {**json.loads(payload), "return_token_ids": True}
    assert got.count(b'"return_token_ids"') == 1
    if b"return_token_ids" not in payload:
        assert got.startswith(payload.rstrip()[:-1].rstrip())  # untouched before it


def test_an_adapters_request_reaches_each_engine_in_the_form_it_takes() -> None:
    """#60: llama.cpp applies one of the adapters it loaded by its index there (its own
    order), with no prompt cache (it reuses one adapter's KV for another's prompt,
    ggml-org/llama.cpp#26207): base requests to it too; other engines take the name as
    the model; the base elsewhere goes byte for byte."""
    upstream = Recorded()
    proxy = Proxy(cast(Upstream, upstream), DeadlineSettings())
    llama = Endpoint(EndpointId("m/l"), "m", "http://l", engine="llamacpp",
                     adapters=("quiet", "loud"))  # fmt: skip
    vllm = dataclasses.replace(llama, engine="vllm")
    sglang = dataclasses.replace(llama, engine="sglang")
    payload = json.dumps({"model": "m", "prompt": "hi"}).encode()
    call = Call(llama, "/v1/completions", payload, False, False, "m", 0.0, {})
    for c in (
        dataclasses.replace(call, adapter=("loud", 0.5)),
        call,
        dataclasses.replace(call, endpoint=vllm, adapter=("loud", 1.0)),
        dataclasses.replace(call, endpoint=vllm),
        dataclasses.replace(call, endpoint=dataclasses.replace(llama, adapters=())),
        dataclasses.replace(call, endpoint=sglang, adapter=("loud", 1.0)),
    ):
        proxy._post(c)
    sent = [json.loads(body) for body, _ in upstream.sent]
    assert sent[0] == {"model": "m", "prompt": "hi", "cache_prompt": False,
                       "lora": [{"id": 1, "scale": 0.5}]}  # fmt: skip
    assert sent[1] == {"model": "m", "prompt": "hi", "cache_prompt": False, "lora": []}
    assert sent[2] == {"model": "loud", "prompt": "hi"}
    assert [body for body, _ in upstream.sent[3:5]] == [payload, payload]
    assert sent[5] == {"model": "m", "prompt": "hi", "lora_path": "loud"}  # SGLang's field
