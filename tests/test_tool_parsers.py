"""Tool calls out of recorded model answers (Qwen2.5-Coder-0.5B and SmolLM2-135M under
cgn-infer), whole and streamed in every split; and the prompt that offers the tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_infer.tool_parsers import ToolCall, parser_for, split

NAMES = ("get_weather", "add")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')

# (answer as the model wrote it, content, calls)
RECORDED = [
    # Qwen2.5-Coder-0.5B, tool_choice required (grammar-forced)
    (CALL, "", [WEATHER]),
    # Qwen2.5-Coder-0.5B, tool_choice auto: the call without its tags
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
    ('{"name": "add", "arguments": {"a": 17, "b": 25}}', "", [ToolCall("add", '{"a": 17, "b": 25}')]),
    # SmolLM2, required with parallel calls, cut by max_tokens inside the fourth
    ("\n".join([CALL] * 3) + '\n<tool_call>\n{"', '\n<tool_call>\n{"', [WEATHER] * 3),
    # text, then a call; a call whose closing tag never came
    ("Let me check.\n" + CALL, "Let me check.", [WEATHER]),
    (CALL.removesuffix("\n</tool_call>"), "", [WEATHER]),
    # arguments written as a JSON string; `parameters` instead of `arguments`
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>', "",
     [ToolCall("add", '{"a": 1, "b": 2}')]),
    ('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>', "", [ToolCall("add", '{"a": 1}')]),
    # not calls: content as written
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),
    ("<tool_call>\nnot json\n</tool_call> sorry", "<tool_call>\nnot json\n</tool_call> sorry", []),
    ("a < b and <tool", "a < b and <tool", []),
    ("  \n", "  \n", []),
]  # fmt: skip


def parse(chunks: list[str]) -> tuple[str, list[ToolCall]]:
    parser = parser_for(NAMES)
    pieces = [p for c in chunks for p in parser.feed(c)]
    return split([*pieces, *parser.finish()])


@pytest.mark.parametrize(("answer", "content", "calls"), RECORDED)
def test_recorded_answers(answer: str, content: str, calls: list[ToolCall]) -> None:
    assert parse([answer]) == (content, calls)


@pytest.mark.parametrize(("answer", "content", "calls"), RECORDED)
def test_every_split_of_a_stream_gives_the_same(
    answer: str, content: str, calls: list[ToolCall]
) -> None:
    for cut in range(1, len(answer)):
        assert parse([answer[:cut], answer[cut:]]) == (content, calls), cut
    assert parse(list(answer)) == (content, calls)  # one character at a time


def test_content_is_not_held_longer_than_needed() -> None:
    parser = parser_for(NAMES)
    assert split(parser.feed("Hello there <tool")) == ("Hello there", [])  # the space waits
    assert split(parser.feed("s are fun")) == (" <tools are fun", [])


@pytest.fixture(scope="module")
def smollm2_codec(smollm2_path: Path) -> Iterator[PromptCodec]:
    with GGUFFile(smollm2_path) as gguf:
        yield PromptCodec.from_gguf(gguf)


def test_a_template_without_tools_gets_the_hermes_prompt(smollm2_codec: PromptCodec) -> None:
    """SmolLM2's template never reads `tools`: they, earlier calls and results are written
    into the conversation in the Hermes format the parser reads."""
    assert not smollm2_codec.template.renders_tools
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]  # fmt: skip
    pieces = smollm2_codec.tokenizer.token_bytes()
    ids = smollm2_codec.encode_chat(history, tools)
    text = b"".join(pieces[i].removeprefix(b"\xff") for i in ids).decode()
    assert text.count("<|im_start|>system") == 1 and "Be brief.\n\nYou may call" in text
    assert json.dumps(tools[0]) in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response>" in text
    assert smollm2_codec.encode_chat(history[:2]) != smollm2_codec.encode_chat(history[:2], tools)
