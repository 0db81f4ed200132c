"""Tool calls out of a model's answer, one module per chat-template family.

A parser is fed the answer's text as it streams and hands back pieces: content to pass
on (`str`) and complete calls (`ToolCall`). Text that may still turn into a call is held
back until it cannot; a call is handed on once it is complete and parses. A block that
does not parse, or names a function the request did not offer, is passed on as content:
the client sees what the model wrote instead of losing it.

Families: `hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Qwen2.5,
Hermes, and the fallback prompt cgn_core.text.prompt gives templates without tools).
It is the only family so far: a template that renders tools in another format (Llama
3.1's JSON, Mistral's `[TOOL_CALLS]`) would need its own module here, picked from the
template's source.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


Piece = str | ToolCall


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Piece]: ...
    def finish(self) -> list[Piece]: ...


def parser_for(names: Iterable[str]) -> ToolParser:
    """A fresh parser for one answer, accepting calls to `names`."""
    from cgn_infer.tool_parsers.hermes import HermesParser

    return HermesParser(frozenset(names))


def split(pieces: Iterable[Piece]) -> tuple[str, list[ToolCall]]:
    """All content joined, and the calls in order."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for p in pieces:
        if isinstance(p, ToolCall):
            calls.append(p)
        else:
            content.append(p)
    return "".join(content), calls
