"""Tool calling on a real Qwen2.5-Coder-0.5B under cgn-infer, through the official openai
client: its own template renders the tools, answers come back as `tool_calls`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from cgn_core.bundled_models import qwen_coder_05b
from harness.procs import cgn_infer

pytestmark = pytest.mark.slow
MODEL = "qwen"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
           "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "Get the current weather in a city"}},
    {"type": "function", "function": {"name": "add", "parameters": ADD,
                                      "description": "Add two integers"}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("tools")
    with cgn_infer(tmp, "--model-name", MODEL, "--ctx", "2048", model=qwen_coder_05b()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def answer(
    client: openai.OpenAI, stream: bool = False, **kw: Any
) -> tuple[Any, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason), from a whole or a streamed answer."""
    kw = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "temperature": 0,
          "max_tokens": 80, **kw}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason
    content, parts, finish = [], {}, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or ():
            name, args = parts.get(call.index, ("", ""))
            assert call.index == len(parts) or call.index in parts
            parts[call.index] = (
                name + (call.function.name or ""),
                args + (call.function.arguments or ""),
            )
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content) or None, [parts[i] for i in sorted(parts)], finish


def valid(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_required_returns_valid_calls_streamed_or_not(client: openai.OpenAI) -> None:
    whole = answer(client, tool_choice="required")
    assert whole[2] == "tool_calls"
    valid(whole[1])
    assert answer(client, stream=True, tool_choice="required") == whole


def test_auto_calls_the_tool_a_prompt_clearly_needs(client: openai.OpenAI) -> None:
    content, calls, finish = answer(client)
    assert finish == "tool_calls" and content is None
    assert [name for name, _ in calls] == ["get_weather"]
    valid(calls)
    assert json.loads(calls[0][1])["city"] == "Paris"
    assert answer(client, stream=True) == (content, calls, finish)


def test_a_named_function_is_forced(client: openai.OpenAI) -> None:
    forced = {"type": "function", "function": {"name": "add"}}
    _, calls, finish = answer(client, tool_choice=forced, parallel_tool_calls=False)
    assert [name for name, _ in calls] == ["add"] and finish == "tool_calls"
    valid(calls)


def test_none_answers_in_text_and_results_go_back_through_the_template(
    client: openai.OpenAI,
) -> None:
    content, calls, finish = answer(client, tool_choice="none", max_tokens=16)
    assert content and not calls and finish in ("stop", "length")
    history = [
        {"role": "user", "content": "What is 17 plus 25? Use the tool."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]  # fmt: skip
    content, calls, _ = answer(client, messages=history, max_tokens=24, tool_choice="none")
    assert content and not calls
