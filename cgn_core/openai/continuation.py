"""Continuing a broken stream on an engine that takes token ids but streams only text (#59).

cgn-infer names the token ids it streams and takes `cgn_resume` (resume.py). llama.cpp's
server does neither on its OpenAI routes, but its `/v1/completions` takes a prompt of token
ids. So, for such an engine, the router keeps the stream's events, and when it breaks:

1. `answer_so_far`: the text the client has received, its response id and creation time,
   read from the events (refused for tool calls, several choices or a malformed event);
2. `continuation_ids`: the prompt's token ids (the chat template and tokenizer the router
   already hashes prompts with, cgn_core/text/prompt.py) and the answer's, re-tokenized;
   refused unless the answer's ids decode back to exactly its text (the round trip);
3. `continuation_body`: a `/v1/completions` request of those ids with the remaining
   `max_tokens` and the same sampling fields, streamed with usage;
4. `Rewriter`: each event of that continuation rewritten as the original request's kind
   (a chat chunk or a completion chunk) with the original id and creation time, and one
   usage that counts the prompt once and the answer across both engines.

A greedy answer continues as it would have (the same ids, the same next token); an
unseeded sampled one continues as another draw would. What cannot be continued this way
(`refusal`): several choices, log probabilities, a seeded sampled answer (the engine
cannot take its random stream up where the other left it), a grammar (response_format,
tools: the grammar cannot be advanced over the text already sent), `echo`, `suffix`,
`best_of`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Sampling and stopping fields a continuation keeps (those /v1/completions takes).
CARRIED = ("temperature", "top_p", "top_k", "min_p", "stop", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "repeat_penalty", "ignore_eos")  # fmt: skip
MAX_EVENTS = 1 << 16  # events a tracked stream keeps (a longer one is not continued)


class Codec(Protocol):
    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None
    ) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...


class Tokenizer(Protocol):
    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def refusal(body: Mapping[str, Any]) -> str:
    """Why a request's stream cannot be continued from its text ("" when it can)."""
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
        return "several choices are not continued"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "log probabilities are not continued"
    if body.get("echo") or body.get("suffix"):
        return "echo and suffix are not continued"
    if body.get("response_format") or body.get("tools") or body.get("json_schema"):
        return "a grammar cannot be advanced over the text already sent on this engine"
    sampled = body.get("temperature", 1.0) not in (0, 0.0)
    if sampled and body.get("seed") is not None:
        return "a seeded sampled answer cannot take up its random stream on another engine"
    return ""


@dataclass(frozen=True, slots=True)
class SoFar:
    text: str
    response_id: str
    created: int
    # what an engine that streams ids (vLLM's `return_token_ids`) named: the prompt's and
    # the answer's; None where any text came without them
    prompt_ids: tuple[int, ...] | None = None
    ids: tuple[int, ...] | None = None


def answer_so_far(events: Sequence[bytes], kind: str) -> SoFar:
    """What a stream sent (its `data:` events, as relayed); ValueError when it cannot say."""
    text, rid, created = [], None, None
    prompt_ids: tuple[int, ...] | None = None
    ids: list[int] | None = []
    for event in events:
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event[6:])
        if not isinstance(chunk, dict):
            raise ValueError("an event is not a JSON object")
        if rid is None:
            rid, created = chunk.get("id"), chunk.get("created")
        if prompt_ids is None and "prompt_token_ids" in chunk:  # vLLM's chat: top level
            prompt_ids = _ids(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                raise ValueError("several choices")
            if prompt_ids is None and "prompt_token_ids" in choice:  # its completions
                prompt_ids = _ids(choice["prompt_token_ids"])
            named = choice.get("token_ids")
            if named is not None and ids is not None:
                ids += _ids(named)
            if kind == "chat":
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict) or delta.get("tool_calls"):
                    raise ValueError("a tool call is not continued from text")
                piece = delta.get("content")
            else:
                piece = choice.get("text")
            if piece is not None and not isinstance(piece, str):
                raise ValueError("a chunk's text is not a string")
            if piece and named is None:
                ids = None  # text without its ids: they are not all known
            text.append(piece or "")
    if not isinstance(rid, str) or type(created) is not int:
        raise ValueError("the stream named no response id")
    named_all = tuple(ids) if ids is not None and prompt_ids is not None else None
    return SoFar("".join(text), rid, created, prompt_ids if named_all is not None else None,
                 named_all)  # fmt: skip


def _ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 1 << 20:
        raise ValueError("token ids are not a list")
    if not all(type(t) is int and 0 <= t < 1 << 31 for t in value):
        raise ValueError("a token id is not one")
    return tuple(value)


def streamed_ids(so_far: SoFar, tokenizer: Tokenizer | None) -> tuple[list[int], int]:
    """(the prompt's ids followed by the answer's, the prompt's length) as the engine named
    them; ValueError when they are not all named, or when the tokenizer (where the router
    has one) decodes the answer's to other text than the stream sent."""
    if so_far.prompt_ids is None or so_far.ids is None:
        raise ValueError("the stream did not name every token id")
    if tokenizer is not None and tokenizer.decode(so_far.ids) != so_far.text:
        raise ValueError("the engine's token ids do not match the text it streamed")
    return [*so_far.prompt_ids, *so_far.ids], len(so_far.prompt_ids)


def continuation_ids(
    codec: Codec, tokenizer: Tokenizer, kind: str, body: Mapping[str, Any], text: str
) -> tuple[list[int], int]:
    """(the prompt's ids followed by the answer's, the prompt's length); ValueError when
    the answer's ids do not decode to exactly its text."""
    from cgn_core.openai.tools import tool_fields
    from cgn_core.text.prompt import chat_messages, completion_prompt

    if kind == "chat":
        prompt = codec.encode_chat(chat_messages(body), tool_fields(body).rendered)
    else:
        words, ids = completion_prompt(body)
        prompt = list(ids) if ids is not None else codec.encode_text(words or "")
    answer = tokenizer.encode(text, add_bos=False) if text else []
    if tokenizer.decode(answer) != text:
        raise ValueError("the answer's text does not round-trip through the tokenizer")
    return prompt + answer, len(prompt)


def continuation_body(
    body: Mapping[str, Any], served: str, ids: Sequence[int], generated: int
) -> dict[str, Any]:
    """The `/v1/completions` request that continues an answer of `generated` tokens."""
    out: dict[str, Any] = {k: body[k] for k in CARRIED if k in body}
    out |= {"model": served, "prompt": list(ids), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if type(limit) is int:
        out["max_tokens"] = max(1, limit - generated)
    return out


class Rewriter:
    """A continuation's `/v1/completions` events as the original request's kind, with its
    id and creation time; its usage counts the prompt once and both engines' output."""

    def __init__(self, kind: str, so_far: SoFar, model: str, prompt: int, generated: int):
        self.kind, self.so_far, self.model = kind, so_far, model
        self.prompt, self.generated = prompt, generated

    def __call__(self, event: bytes) -> list[bytes]:
        if not event.startswith(b"data: {"):
            return [event]  # [DONE], comments
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return [event]
        if not isinstance(chunk, dict):
            return [event]
        out: dict[str, Any] = {
            "id": self.so_far.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.so_far.created,
            "model": self.model,
            "choices": [self._choice(c) for c in chunk.get("choices") or () if isinstance(c, dict)],
        }
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return [_event(out)]
        done = usage.get("completion_tokens")
        done = done if type(done) is int and done >= 0 else 0
        total = self.generated + done
        counted = {"prompt_tokens": self.prompt, "completion_tokens": total,
                   "total_tokens": self.prompt + total}  # fmt: skip
        # NOTE: llama.cpp puts the usage in its last chunk of text; OpenAI's streams (and the
        # router's accounting) have it alone, in a chunk without choices
        alone = {**out, "choices": [], "usage": counted}
        return [_event(out), _event(alone)] if out["choices"] else [_event(alone)]

    def _choice(self, choice: Mapping[str, Any]) -> dict[str, Any]:
        text = choice.get("text")
        text = text if isinstance(text, str) else ""
        finish = choice.get("finish_reason")
        finish = finish if isinstance(finish, str) else None
        if self.kind == "chat":
            out = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        else:
            out = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if isinstance(named := choice.get("token_ids"), list):  # kept: it may break again
            out["token_ids"] = named
        return out


def _event(chunk: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
