"""Test stand-in: an OpenAI server speaking vLLM's token-id fields (no GPU, no model).

Built from vLLM's published protocol (`return_token_ids`, vLLM PR #22587 and its
docs): with `"return_token_ids": true`, a streamed chat answer's first chunk carries the
templated prompt's ids at the top level (`prompt_token_ids`) and every choice the ids of
its text (`token_ids`); a streamed completion carries `prompt_token_ids` and `token_ids`
on its choices. `/v1/completions` takes a prompt of token ids. Its "model" is a function
of the whole context (the next id from the ids so far), so an answer continued from its
ids on another stand-in is the one an undisturbed stream gives, and its text is one word
per id. Every request body is kept (`GET /requests`) for tests that check what was sent.

    python -m harness.vllm_stub --port 8001 [--token-delay 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web

VOCAB = 500


def template(messages: list[dict[str, Any]]) -> list[int]:
    """The stand-in's chat template and tokenizer: a role id, then one id per character."""
    ids = [1]
    for m in messages:
        ids.append({"system": 2, "user": 3, "assistant": 4}.get(str(m.get("role")), 5))
        ids += [10 + ord(c) % 200 for c in str(m.get("content") or "")]
    return [*ids, 4]  # the generation prompt: the assistant's turn


def next_id(context: list[int]) -> int:
    h = 17
    for t in context[-64:]:
        h = (h * 31 + t) % 1_000_003
    return 300 + (h + len(context)) % (VOCAB - 300)


def word(token: int) -> str:
    return f" w{token}"


def build_app(delay_s: float) -> web.Application:
    seen: list[dict[str, Any]] = []

    async def stream(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if chat:
            prompt = template(body.get("messages", []))
        elif isinstance(body.get("prompt"), list):
            prompt = [int(t) for t in body["prompt"]]
        else:
            prompt = [10 + ord(c) % 200 for c in str(body.get("prompt", ""))]
        ids_on = bool(body.get("return_token_ids"))
        limit = int(body.get("max_tokens") or 16)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{len(seen)}", int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": created, "model": body.get("model")}

        async def send(choices: list[dict[str, Any]], **top: Any) -> None:
            chunk = {**head, "choices": choices, **top}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        if chat:
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
            await send([first], **({"prompt_token_ids": prompt} if ids_on else {}))
        context = list(prompt)
        for i in range(limit):
            await asyncio.sleep(delay_s)
            token = next_id(context)
            context.append(token)
            finish = "length" if i == limit - 1 else None
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": word(token)}, "finish_reason": finish}
                if chat else {"index": 0, "text": word(token), "finish_reason": finish}
            )  # fmt: skip
            if ids_on:
                choice["token_ids"] = [token]
                if not chat and i == 0:
                    choice["prompt_token_ids"] = prompt
            await send([choice])
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": limit,
                     "total_tokens": len(prompt) + limit}  # fmt: skip
            await send([], usage=usage)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        return await stream(request, True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await stream(request, False)

    async def requests(_: web.Request) -> web.Response:
        return web.json_response(seen)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/requests", requests)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-delay", type=float, default=0.05)
    args = ap.parse_args()
    web.run_app(build_app(args.token_delay), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
