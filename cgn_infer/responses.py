"""OpenAI response bodies and SSE chunks for chat and text completions (pure functions)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cgn_core.openai.resume import Resume
from cgn_core.openai.tools import NO_TOOLS, ToolFields
from cgn_infer.events import FinishEvent, TokenEvent
from cgn_infer.protocol import Kind
from cgn_infer.tool_parsers import ToolCall, ToolParser, parser_for, split

_OBJECT = {
    ("chat", False): "chat.completion",
    ("chat", True): "chat.completion.chunk",
    ("completion", False): "text_completion",
    ("completion", True): "text_completion",
}


@dataclass(slots=True)
class ResponseBuilder:
    kind: Kind
    model: str
    token_text: Any  # Callable[[int], str]
    logprobs: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    lp_items: list[Any] = field(default_factory=list)
    _offset: int = 0
    tools: ToolFields = NO_TOOLS
    _parser: ToolParser | None = None
    _calls: int = 0  # tool calls streamed so far
    _resumed: bool = False  # continuing another engine's stream: its role chunk went out

    def __post_init__(self) -> None:
        if self.kind == "chat" and self.tools.rendered:
            self._parser = parser_for(t["function"]["name"] for t in self.tools.tools)

    @property
    def response_id(self) -> str:
        return self.id if self._resumed else self._prefix + self.id

    @property
    def _prefix(self) -> str:
        return "chatcmpl-" if self.kind == "chat" else "cmpl-"

    def resume(self, resume: Resume, text: str) -> None:
        """Continue another engine's stream: its id and creation time, no role chunk, and
        the tool-call parser (and logprob offsets) where `text`, what the client has of
        the answer, left them. A call that text completed was streamed whole: counted."""
        self.id, self.created, self._resumed = resume.response_id, resume.created, True
        if self._parser is not None:
            _, calls = split(self._parser.feed(text))
            self._calls += len(calls)
        self._offset = sum(len(self.token_text(t)) for t in resume.token_ids)

    def _envelope(self, stream: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": _OBJECT[(self.kind, stream)],
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprob_entry(self, ev: TokenEvent) -> Any:
        s = ev.sampled
        tok = self.token_text(s.token)
        if self.kind == "chat":
            return {
                "token": tok,
                "logprob": s.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(i)), "logprob": lp, "bytes": list(t.encode())}
                    for i, lp in s.top
                ],
            }
        entry = (tok, s.logprob, {self.token_text(i): lp for i, lp in s.top}, self._offset)
        self._offset += len(tok)
        return entry

    def _lp_block(self, items: list[Any]) -> Any:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": items}
        return {
            "tokens": [t for t, _, _, _ in items],
            "token_logprobs": [lp for _, lp, _, _ in items],
            "top_logprobs": [top for _, _, top, _ in items],
            "text_offset": [off for _, _, _, off in items],
        }

    def _choice(
        self, text: str, finish: str | None, lp: list[Any], first: bool, stream: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            if stream:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                delta["content"] = text
                choice["delta"] = delta
            elif self._parser is not None:
                content, calls = split([*self._parser.feed(text), *self._parser.finish()])
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["content"] = content or None  # as streamed: see tool_parsers
                    message["tool_calls"] = [_call_json(c) for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
                choice["message"] = message
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._lp_block(lp)
        choice["finish_reason"] = finish
        return choice

    # ---- streaming ---------------------------------------------------------------

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with a role-only delta, as OpenAI's do."""
        if self.kind != "chat" or self._resumed:
            return None
        return self._envelope(True, [self._choice("", None, [], True, True)])

    def token_chunks(self, ev: TokenEvent) -> list[dict[str, Any]]:
        """The chunks one token adds: its text (and logprobs), and any tool call it completed."""
        lp = [self._logprob_entry(ev)] if self.logprobs else []
        return self._text_chunks(ev.text, lp)

    def finish_chunks(self, ev: FinishEvent) -> list[dict[str, Any]]:
        """The held-back text and calls, then the chunk with the finish reason."""
        chunks = self._text_chunks(ev.text, [], final=True)
        reason = _reason(ev)
        if self._calls and reason == "stop":
            reason = "tool_calls"
        choice = self._choice("", reason, [], False, True)
        choice["logprobs"] = None
        return [*chunks, self._envelope(True, [choice])]

    def _text_chunks(self, text: str, lp: list[Any], final: bool = False) -> list[dict[str, Any]]:
        if self._parser is None:
            if not text and not lp:
                return []
            return [self._envelope(True, [self._choice(text, None, lp, False, True)])]
        pieces = self._parser.feed(text) + (self._parser.finish() if final else [])
        content, calls = split(pieces)
        chunks = []
        if content or lp:
            chunks.append(self._envelope(True, [self._choice(content, None, lp, False, True)]))
        for call in calls:
            choice = self._choice("", None, [], False, True)
            choice["delta"] = {"tool_calls": [{"index": self._calls, **_call_json(call)}]}
            chunks.append(self._envelope(True, [choice]))
            self._calls += 1
        return chunks

    def usage_chunk(self, ev: FinishEvent) -> dict[str, Any]:
        body = self._envelope(True, [])
        body["usage"] = usage(ev)
        return body

    # ---- whole responses ------------------------------------------------------------

    def add(self, ev: TokenEvent) -> None:
        self.text.append(ev.text)
        if self.logprobs:
            self.lp_items.append(self._logprob_entry(ev))

    def final(self, ev: FinishEvent) -> dict[str, Any]:
        text = "".join(self.text) + ev.text
        body = self._envelope(False, [self._choice(text, _reason(ev), self.lp_items, True, False)])
        body["usage"] = usage(ev)
        return body


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _reason(ev: FinishEvent) -> str:
    return "length" if ev.reason == "length" else "stop"


def usage(ev: FinishEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
    }
