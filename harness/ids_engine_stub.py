"""Test stand-in: an OpenAI server of a GPU engine's token-id API (no GPU, no model).

Two dialects, each from the engine's published protocol:
- `vllm` (`return_token_ids`, vLLM PR #22587 and its docs): with `"return_token_ids":
  true`, a streamed chat answer's first chunk carries the templated prompt's ids at the
  top level (`prompt_token_ids`) and every choice the ids of its text (`token_ids`); a
  streamed completion carries `prompt_token_ids` and `token_ids` on its choices. Its chat
  template and tokenizer are its own (one id per character, one word per output id).
- `sglang` (and TensorRT-LLM's trtllm-serve, whose OpenAI routes are the same here):
  streams text only; its `/v1/completions` takes `prompt` as a list of token ids (the
  engine's `input_ids`). It templates and tokenizes with a real GGUF's tokenizer
  (`--tokenizer`, the one the router is given), and writes only whole-word tokens, so
  its text re-tokenizes to the ids it wrote.

Both take a prompt of token ids on `/v1/completions`. The "model" is a function of the
whole context (the next id from the ids so far), so an answer continued from its ids on
another stand-in is the one an undisturbed stream gives. Every request body is kept
(`GET /requests`) for tests that check what was sent.

    python -m harness.ids_engine_stub --port 8001 [--token-delay 0.05]
                                      [--dialect sglang --tokenizer model.gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
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


class Vocabulary:
    """What a dialect templates, tokenizes and writes with (vLLM's: its own)."""

    names_ids = True  # answers `return_token_ids` (vLLM); SGLang streams text only

    def template(self, messages: list[dict[str, Any]]) -> list[int]:
        return template(messages)

    def encode(self, text: str) -> list[int]:
        return [10 + ord(c) % 200 for c in text]

    def token(self, context: list[int]) -> tuple[int, str]:
        token = next_id(context)
        return token, word(token)


class GGUFVocabulary(Vocabulary):
    """A real model's chat template and tokenizer; output from its whole-word tokens only
    (" the", " and", ...: each one token, and a run of them re-tokenizes to the same ids)."""

    def __init__(self, path: str):
        from cgn_core.text.gguf_file import GGUFFile
        from cgn_core.text.prompt import PromptCodec

        with GGUFFile(Path(path)) as gguf:
            self.codec = PromptCodec.from_gguf(gguf)
        tok = self.codec.tokenizer
        pieces = tok.pieces
        self.words = [
            i for i, p in enumerate(pieces)
            if p.startswith("Ġ") and p[1:].isalpha() and p[1:].islower() and len(p) > 3
        ][:VOCAB]  # fmt: skip
        self.names_ids = False
        self.text = {i: tok.decode([i]) for i in self.words}

    def template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.codec.encode_chat(messages)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode_text(text)

    def token(self, context: list[int]) -> tuple[int, str]:
        token = self.words[next_id(context) % len(self.words)]
        return token, self.text[token]


def build_app(delay_s: float, vocab: Vocabulary | None = None) -> web.Application:
    vocab = vocab or Vocabulary()
    seen: list[dict[str, Any]] = []

    async def stream(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if chat:
            prompt = vocab.template(body.get("messages", []))
        elif isinstance(body.get("prompt"), list):
            prompt = [int(t) for t in body["prompt"]]
        else:
            prompt = vocab.encode(str(body.get("prompt", "")))
        ids_on = bool(body.get("return_token_ids")) and vocab.names_ids
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
            token, text = vocab.token(context)
            context.append(token)
            finish = "length" if i == limit - 1 else None
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                if chat else {"index": 0, "text": text, "finish_reason": finish}
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
    ap.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--tokenizer", help="sglang: the GGUF whose template and tokenizer it uses")
    args = ap.parse_args()
    if args.dialect == "sglang" and not args.tokenizer:
        ap.error("--dialect sglang needs --tokenizer")
    vocab = GGUFVocabulary(args.tokenizer) if args.dialect == "sglang" else Vocabulary()
    web.run_app(build_app(args.token_delay, vocab), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
