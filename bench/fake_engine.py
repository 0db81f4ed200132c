"""A minimal OpenAI-shaped upstream that answers at once: the router's overhead benchmark.

    python bench/fake_engine.py PORT [PORT ...]

POST /v1/chat/completions and /v1/completions: a fixed small completion (or,
with "stream": true, one SSE chunk per `max_tokens` (3 when absent, at most
4096), a usage chunk and [DONE]); GET /metrics: vLLM-named gauges;
GET /health: 200; GET /v1/models, /get_model_info, /get_server_info: what a
gateway (SGLang's smg) asks a worker before routing to it; GET
/v1/kv/events[?ns=MODEL]: a KV event stream holding no block (an empty
snapshot in namespace MODEL, "fake" by default), kept open. Several ports:
one process serves them all, so a router sees several engines on one core.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import uvloop
from aiohttp import web

BODY = json.dumps({
    "id": "cmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
}).encode()  # fmt: skip
CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
USAGE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":3,"total_tokens":11}}\n\n'
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"


MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
MODELS = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model",
                                                 "owned_by": "bench"}]}).encode()  # fmt: skip
INFO = json.dumps({"model_path": "fake", "tokenizer_path": "fake", "is_generation": True,
                   "served_model_name": "fake"}).encode()  # fmt: skip


async def complete(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream": true' not in body and b'"stream":true' not in body:
        return web.Response(body=BODY, content_type="application/json")
    m = MAX_TOKENS.search(body)
    n = min(4096, int(m.group(1))) if m else 3
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(CHUNK * n + USAGE + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def kv_events(request: web.Request) -> web.StreamResponse:
    snapshot = {
        "snapshot": {"seq": "0", "block_size": 16, "namespace": request.query.get("ns", "fake")}
    }
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: " + json.dumps(snapshot).encode() + b"\n\n")
    await asyncio.Event().wait()  # open until the subscriber leaves
    return resp


async def info(_: web.Request) -> web.Response:
    return web.Response(body=INFO, content_type="application/json")


async def models(_: web.Request) -> web.Response:
    return web.Response(body=MODELS, content_type="application/json")


async def metrics(_: web.Request) -> web.Response:
    return web.Response(body=METRICS, content_type="text/plain")


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/kv/events", kv_events)
    app.router.add_get("/get_model_info", info)
    app.router.add_get("/get_server_info", info)
    uvloop.run(serve([int(p) for p in sys.argv[1:]], app))


async def serve(ports: list[int], app: web.Application) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
