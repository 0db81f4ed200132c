"""The Hermes tool-call format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

Qwen2.5's template asks for it, and so does the fallback tool prompt. Between calls the
model may write text (content). `</tool_call>` missing at the end of the answer is
forgiven when the block's JSON is complete (a model stopping at the brace), and an answer
that is nothing but such a JSON object is a call too (Qwen2.5-Coder-0.5B answers so
under `auto`); an answer opening with `{` is therefore held until it ends. Whitespace
around calls is not content (it only separates them), so a streamed answer reassembles
to the same message as a whole one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from cgn_infer.tool_parsers import Piece, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class HermesParser:
    names: frozenset[str]
    _buf: str = ""
    _inside: bool = False
    _out: list[Piece] = field(default_factory=list)
    _space: str = ""  # whitespace held until it is known not to only separate calls
    _called: bool = False
    _bare: bool | None = None  # the answer opens with "{": undecided until it ends

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        if self._bare is None and (head := self._buf.lstrip()):
            self._bare = head.startswith("{") and not self._out and not self._called
        if self._bare:  # held whole: it may be a call written without its tags
            return []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end == -1:
                    break
                self._block(self._buf[:end], closed=True)
                self._buf, self._inside = self._buf[end + len(CLOSE) :], False
                continue
            start = self._buf.find(OPEN)
            if start == -1:
                keep = _partial_suffix(self._buf, OPEN)
                self._content(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._content(self._buf[:start])
            self._buf, self._inside = self._buf[start + len(OPEN) :], True
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Piece]:
        if self._bare:
            self._bare = False
            if (call := _call(self._buf.strip(), self.names)) is not None:
                self._buf = ""
                self._out.append(call)
                self._called = True
            else:
                pieces = self.feed("")  # NOTE: feed swaps self._out: read it after
                self._out.extend(pieces)
        if self._inside:
            self._block(self._buf, closed=False)
        else:
            self._content(self._buf)
        if self._space and not self._called:
            self._out.append(self._space)
        self._buf, self._inside, self._space = "", False, ""
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        # NOTE: trailing whitespace waits: it is dropped if a call follows (it only
        # separated the two), whatever the stream's split
        body = text.rstrip()
        if body:
            self._out.append(self._space + body)
            self._space = ""
        self._space += text[len(body) :]

    def _block(self, body: str, *, closed: bool) -> None:
        call = _call(body, self.names)
        if call is not None:
            self._out.append(call)
            self._space, self._called = "", True
        else:
            self._content(OPEN + body + (CLOSE if closed else ""))


def _call(body: str, names: frozenset[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back for now)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
