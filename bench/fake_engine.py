"""A minimal OpenAI-shaped upstream that answers at once: the router's overhead benchmark.

    python bench/fake_engine.py PORT

POST /v1/chat/completions and /v1/completions: a fixed small completion (or,
with "stream": true, three SSE chunks, a usage chunk and [DONE]);
GET /metrics: vLLM-named gauges; GET /health: 200.
"""

from __future__ import annotations

import json
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


async def complete(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream": true' not in body and b'"stream":true' not in body:
        return web.Response(body=BODY, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(CHUNK * 3 + USAGE + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


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
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
