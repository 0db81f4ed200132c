"""OpenAI tool calling fields, checked once for router and engine: `tools`, `tool_choice`,
`parallel_tool_calls`, and the tool calls and results in a chat's history.

`tool_fields(body)` validates the request's tools and choice. What the model is shown
(`ToolFields.rendered`) feeds the chat template, so the router's prompt hashes cover the
tool definitions exactly as the engine tokenizes them. With `tool_choice: "none"` no tools
are rendered: the model is not offered what it may not call.

`history_message(msg, where)` normalises an assistant message's `tool_calls` for the
template: OpenAI sends `arguments` as a JSON string, and chat templates (Qwen2.5's,
Hermes') write it with `tojson`, so it is parsed into its object first (as vLLM does).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cgn_core import safejson
from cgn_core.errors import InvalidRequest

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolFields:
    tools: tuple[dict[str, Any], ...]  # as sent, each {"type": "function", "function": {...}}
    choice: str  # none | auto | required | named
    name: str | None  # the forced function when choice == "named"
    parallel: bool  # more than one call allowed in an answer

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (None: none)."""
        return [dict(t) for t in self.tools] if self.tools and self.choice != "none" else None

    def function(self, name: str) -> dict[str, Any] | None:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict(tool["function"])
        return None


NO_TOOLS = ToolFields((), "none", None, True)


def tool_fields(body: Mapping[str, Any]) -> ToolFields:
    """Validate `tools`, `tool_choice` and `parallel_tool_calls` (absent: no tools)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if raw is None:
        if choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return NO_TOOLS
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'tools' must be a non-empty list", param="tools")
    if len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' accepts at most {MAX_TOOLS} functions", param="tools")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        fn = _function(tool, f"tools[{i}]")
        if fn["name"] in names:
            raise InvalidRequest(
                f"tools[{i}]: duplicate function name {fn['name']!r}", param=f"tools[{i}]"
            )
        names.add(fn["name"])
        tools.append({"type": "function", "function": fn})
    name: str | None = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        forced = choice.get("function")
        if choice.get("type") != "function" or not isinstance(forced, dict):
            raise InvalidRequest(
                "'tool_choice' must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        name = forced.get("name")
        if not isinstance(name, str) or name not in names:
            raise InvalidRequest(
                f"'tool_choice' names {name!r}, which is not in 'tools'", param="tool_choice"
            )
        choice = "named"
    elif choice not in CHOICES:
        raise InvalidRequest(
            "'tool_choice' must be none, auto, required or a function", param="tool_choice"
        )
    return ToolFields(tuple(tools), str(choice), name, parallel)


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest(
            f'{where} must be {{"type": "function", "function": {{...}}}}', param=where
        )
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{where}.function must be an object", param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidRequest(
            f"{where}.function.name must be 1-64 letters, digits, _ or -", param=where
        )
    out: dict[str, Any] = {"name": name}
    if (desc := fn.get("description")) is not None:
        if not isinstance(desc, str):
            raise InvalidRequest(f"{where}.function.description must be a string", param=where)
        out["description"] = desc
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidRequest(
            f"{where}.function.parameters must be a JSON schema object", param=where
        )
    out["parameters"] = params
    if (strict := fn.get("strict")) is not None:
        if not isinstance(strict, bool):
            raise InvalidRequest(f"{where}.function.strict must be a boolean", param=where)
        out["strict"] = strict
    return out


def history_message(msg: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message's `tool_calls` checked, with each `arguments` parsed."""
    calls = msg.get("tool_calls")
    if calls is None:
        return msg
    if msg.get("role") != "assistant" or not isinstance(calls, list):
        raise InvalidRequest(
            f"{where}.tool_calls must be a list on an assistant message", param=where
        )
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{at} must name a function", param=at)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            args = safejson.loads(args or "{}", f"{at}.function.arguments", param=at)
        out.append({**call, "function": {"name": fn["name"], "arguments": args}})
    return {**msg, "tool_calls": out}
